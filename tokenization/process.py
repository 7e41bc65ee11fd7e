"""Tokenizing in a child process, ahead of the caller, so a pipeline worker's tokenizing (pure Python, holding
the GIL) runs on another core beside its biLM.

TokenizerProcesses(mode, processes) starts `processes` x `python -m elmo_pipeline.tokenization.process MODE` (it imports only
this package, not torch or Beam; multiprocessing's spawn would import the caller's __main__). The caller
put()s documents; they go to the children, in turn, in chunks of about `chunk_chars` characters, at most
`ahead` chunks in flight (default 64: about 1M characters, more than a --sort-buffer of sentences, so the
children keep tokenizing while the caller embeds a whole sort buffer); put() and drain() yield (key, result) in the order the documents were put, result =
tokenize_document()'s list of Sentence, or the exception's one-line text ("TypeError: ...") when the
tokenizer failed on that document. Results are the same as tokenizing in the caller. A child that dies
raises RuntimeError in the caller. Two children fill a worker's first sort buffer, when its biLM has
nothing to do yet, twice as fast.

Wire: pickled (protocol 5) messages on the child's stdin and stdout, one per chunk: [(text, split_sentences)]
in, [list[(tokens, offsets)] | str] out. Two threads of the caller write chunks and read replies, so the
caller never waits on a full pipe and neither side can block the other.
"""
from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from typing import Any, Iterator

from elmo_pipeline.tokenization.tokenizers import Sentence, tokenize_document

_EOF = object()


class _Child:
    """One `python -m elmo_pipeline.tokenization.process MODE` with a thread writing its chunks and one reading
    its replies."""

    def __init__(self, mode: str):
        import elmo_pipeline
        root = os.path.dirname(os.path.dirname(os.path.abspath(elmo_pipeline.__file__)))   # where it is imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.tokenization.process", mode], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.replies: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="elmo-tokenizer-reader", daemon=True)
        self.writer = threading.Thread(target=self._write, name="elmo-tokenizer-writer", daemon=True)
        self.reader.start()
        self.writer.start()

    def _read(self) -> None:
        while True:
            try:
                self.replies.put(pickle.load(self.proc.stdout))
            except Exception:  # noqa: BLE001 - EOF or a broken pipe: the child is gone
                self.replies.put(_EOF)
                return

    def _write(self) -> None:
        while (chunk := self.outbox.get()) is not None:
            try:
                pickle.dump(chunk, self.proc.stdin, protocol=5)
                self.proc.stdin.flush()
            except OSError:          # the child is gone: the reader reports it
                return
        try:
            self.proc.stdin.close()  # the child exits at the end of its input
        except OSError:
            pass

    def receive(self) -> list:
        reply = self.replies.get()
        if reply is _EOF:
            self.replies.put(_EOF)      # for every later call too: it must not wait for a reply that never comes
            raise RuntimeError(f"the tokenizer process exited ({self.proc.wait()})")
        return reply

    def close(self, kill: bool = False) -> None:
        if kill:                   # its results are not wanted: no waiting for what it still has to tokenize
            self.proc.kill()
        self.outbox.put(None)
        self.writer.join(timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)


class TokenizerProcesses:
    """`processes` children, chunks dealt to them in turn; results in the order the documents were put."""

    def __init__(self, mode: str, processes: int = 1, chunk_chars: int = 16_384, ahead: int = 64):
        self.chunk_chars, self.ahead = chunk_chars, ahead
        self.children = [_Child(mode) for _ in range(max(1, processes))]
        self.chunk: list[tuple[Any, str, bool]] = []     # (key, text, split) not yet sent
        self.chars = 0
        self.sent: list[tuple[_Child, list[Any]]] = []   # (child, keys) of the chunks in flight, oldest first
        self.dealt = 0

    def put(self, key: Any, text: str, split_sentences: bool = True) -> Iterator[tuple[Any, list[Sentence] | str]]:
        """Queue one document; yield the results that are ready (waiting only when `ahead` chunks are in flight)."""
        self.chunk.append((key, text, split_sentences))
        self.chars += len(text or "")
        if self.chars >= self.chunk_chars:
            self._send()
        while self.sent and (len(self.sent) > self.ahead or not self.sent[0][0].replies.empty()):
            yield from self._receive()

    def drain(self) -> Iterator[tuple[Any, list[Sentence] | str]]:
        """Send what is queued and yield every result still owed."""
        self._send()
        while self.sent:
            yield from self._receive()

    def _send(self) -> None:
        if not self.chunk:
            return
        chunk, self.chunk, self.chars = self.chunk, [], 0
        child = self.children[self.dealt % len(self.children)]
        self.dealt += 1
        child.outbox.put([(t, sp) for _, t, sp in chunk])
        self.sent.append((child, [k for k, _, _ in chunk]))

    def _receive(self) -> Iterator[tuple[Any, list[Sentence] | str]]:
        child, keys = self.sent[0]
        reply = child.receive()
        self.sent.pop(0)
        for key, res in zip(keys, reply):
            yield key, res if isinstance(res, str) else [Sentence(t, o) for t, o in res]

    def close(self) -> None:
        """End the children (each exits when its input closes; killed when results are still owed, as after a
        failed bundle) and wait for them."""
        owed = bool(self.sent or self.chunk)
        for c in self.children:
            c.close(kill=owed)


def tokenize_or_reason(text: str, mode: str, split_sentences: bool) -> list[Sentence] | str:
    """tokenize_document(), or the exception's one-line text when it fails."""
    try:
        return tokenize_document(text, mode, split_sentences)
    except Exception as e:  # noqa: BLE001 - one document must not fail the job
        return f"{type(e).__name__}: {e}"


def serve(mode: str, stdin=None, stdout=None) -> None:
    """The child: read chunks until the input ends, reply to each. It returns, quietly, when its reader is gone
    (the caller exited or was killed: its replies would reach nobody)."""
    stdin, stdout = stdin or sys.stdin.buffer, stdout or sys.stdout.buffer
    while True:
        try:
            chunk = pickle.load(stdin)
        except EOFError:
            return
        out = []
        for text, split in chunk:
            res = tokenize_or_reason(text, mode, split)
            out.append(res if isinstance(res, str) else [(s.tokens, s.offsets) for s in res])
        try:
            pickle.dump(out, stdout, protocol=5)
            stdout.flush()
        except BrokenPipeError:
            _drop_unread(stdout)
            return


def _drop_unread(stdout) -> None:
    """Point the stream nobody reads at os.devnull, so that the interpreter's last flush of what it still buffers
    raises nothing."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stdout.fileno())
        os.close(null)
        stdout.flush()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the caller's to handle; stdin's end stops us
    serve(sys.argv[1])
