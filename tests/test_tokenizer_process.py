"""Tokenizing in a child process (tokenization/process.py): the same sentences, offsets and failure reasons as
inline, in the order the documents were put; a child that dies is an error, not lost documents; the pipeline
writes the same output with it as without."""
import os
import signal

import pytest

from tests import robustness_corpus as rc
from elmo_pipeline.tokenization.process import TokenizerProcesses, tokenize_or_reason

pytestmark = pytest.mark.slow          # starts processes

DOCS = ["The High-Speed train left. It was late, wasn't it?", "", "   ", "Zürich 東京 😀 \u200b\x00 text.",
        "One sentence without a stop", None, "a" * 5000 + " b. c.", "\ufeffBOM then words."]


def _texts():
    cases = [c.decode("utf-8", "replace") for c in rc.generated_cases().values()]
    return DOCS + cases + [f"Document {i} says {i * 7} things. Then more." for i in range(300)]


@pytest.mark.parametrize("mode", ["wikitext", "moses", "whitespace"])
@pytest.mark.parametrize("processes,chunk_chars,ahead", [(1, 1, 1), (2, 200, 2), (2, 16_384, 64)])
def test_same_results_as_inline_in_order(mode, processes, chunk_chars, ahead):
    texts = _texts()
    child = TokenizerProcesses(mode, processes, chunk_chars=chunk_chars, ahead=ahead)
    try:
        got = []
        for i, t in enumerate(texts):
            got.extend(child.put(i, t, i % 3 != 0))
        got.extend(child.drain())
    finally:
        child.close()
    assert [k for k, _ in got] == list(range(len(texts)))
    for (i, res), t in zip(got, texts):
        assert res == tokenize_or_reason(t, mode, i % 3 != 0), i
    assert isinstance(got[DOCS.index(None)][1], str) and "Error: " in got[DOCS.index(None)][1]   # a failing document
    assert [c.proc.returncode for c in child.children] == [0] * processes


def test_a_killed_child_is_an_error():
    child = TokenizerProcesses("wikitext", 2, chunk_chars=1)
    try:
        list(child.put(0, "Fine. Text.", True))
        os.kill(child.children[1].proc.pid, signal.SIGKILL)
        child.children[1].proc.wait()
        with pytest.raises(RuntimeError, match="tokenizer process exited"):
            for i in range(1, 50):
                list(child.put(i, "More text.", True))
            list(child.drain())
    finally:
        child.close()


def test_a_dead_child_is_an_error_every_time_it_is_asked():
    """After the error, asking again (drain, another put) raises again instead of waiting for ever."""
    import threading
    child = TokenizerProcesses("wikitext", 1, chunk_chars=1)
    errors = []

    def ask():
        for _ in range(2):
            try:
                list(child.drain())
            except RuntimeError as e:
                errors.append(str(e))
    try:
        list(child.put(0, "Fine. Text.", True))
        child.children[0].proc.kill()
        child.children[0].proc.wait()
        with pytest.raises(RuntimeError, match="tokenizer process exited"):
            list(child.put(1, "More text.", True))
            list(child.drain())
        t = threading.Thread(target=ask, daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "drain() waits for a reply from a dead child"
        assert len(errors) == 2 and all("tokenizer process exited" in e for e in errors)
    finally:
        child.close()


def _tokenizer_processes_alive() -> list[int]:
    """Pids of `python -m elmo_pipeline.tokenization.process` processes whose parent is this process."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and b"elmo_pipeline.tokenization.process" in cmd:
            out.append(int(pid))
    return out


@pytest.mark.parametrize("fail", [False, True])
def test_no_child_or_thread_left_after_a_run(fail, tmp_path, tiny_model_files, monkeypatch):
    """The children were started and are gone, with their threads, after a run, and after a failed one."""
    import threading
    import elmo_pipeline.tokenization.process as TP
    from elmo_pipeline.output.sink import Sink
    from elmo_pipeline.pipeline.run import main
    from tests.resume_helpers import argv, write_corpus
    started = []
    monkeypatch.setattr(TP._Child, "__init__", lambda self, mode, init=TP._Child.__init__: (
        init(self, mode), started.append(self.proc))[0])
    if fail:
        def full(*a, **k):      # a sink whose disk is full
            raise OSError("No space left on device (test)")
        monkeypatch.setattr(Sink, "open", full)
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=20)
    rc = main(argv(tiny_model_files, corpus, str(tmp_path / "out"), "--tokenizer-process", "on"))
    assert rc == (75 if fail else 0)      # out of space: retry later (pipeline/exits.py)
    assert started and all(p.returncode is not None for p in started)
    assert _tokenizer_processes_alive() == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("elmo-tokenizer")]


def test_a_failed_bundles_documents_are_not_emitted_with_the_next():
    """A bundle that failed after handing documents over (no finish_bundle), then another bundle on the same
    DoFn: only that bundle's Items come out."""
    from elmo_pipeline.transforms.tokenize_step import Tokenize
    from elmo_pipeline.transforms.records import Document, Item
    t = Tokenize("wikitext", 1000, processes=1)
    t.setup()
    try:
        t.start_bundle()
        for i in range(5):
            list(t.process(Document(f"old:{i}", "Stale text. Of a failed bundle.")))
        t.start_bundle()
        out = list(t.process(Document("new:1", "Fresh text here.")))
        out += [o.value for o in t.finish_bundle()]
        assert [o.doc_id for o in out if isinstance(o, Item)] == ["new:1"]
    finally:
        t.teardown()
    assert all(c.proc.returncode is not None for c in t.child.children)


def test_pipeline_output_same_with_and_without(tmp_path, tiny_model_files):
    """Dirty input (dead letters included), several sentences per document: equal outputs, files byte for byte."""
    from tests.resume_helpers import assert_flag_changes_no_byte
    assert_flag_changes_no_byte(tmp_path, tiny_model_files, "--tokenizer-process", ("on", "off"),
                                "--max-sentence-tokens", "24", "--max-tokens-per-batch", "256")


def test_closing_with_results_owed_does_not_wait_for_them():
    """After a failed bundle nobody wants what the children still have queued: close() kills them at once
    (after a drain() they exit by themselves, code 0: test_same_results_as_inline_in_order)."""
    child = TokenizerProcesses("wikitext", 2, chunk_chars=1)
    for i in range(200):
        list(child.put(i, "A sentence with some words in it . " * 200, True))
    assert child.sent
    child.close()
    assert [c.proc.returncode for c in child.children] == [-signal.SIGKILL] * 2
