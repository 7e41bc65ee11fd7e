"""Language-model training data: corpus reading, vocabulary building, batches of line windows.

Every non-blank line (a sentence or paragraph) is split into windows of at most `max_tokens` tokens;
each window becomes <S> w_1 ... w_n </S> and is an independent sequence (LSTM state starts at zero,
the same as the embedder's default `stateless` mode). The forward LM predicts w_1 .. w_n, </S>;
the backward LM predicts <S>, w_1 .. w_n.

Batches are deterministic functions of (seed, epoch, batch index): an exact `--resume` needs only
those numbers, never a saved iterator.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from elmo_pipeline.fsio import bounded_lines
from elmo_pipeline.model.char_ids import BOS_TOKEN, EOS_TOKEN, MAX_CHARS, token_char_ids
from elmo_pipeline.model.vocab import SPECIALS, Vocabulary

Tokenizer = Callable[[str], list[list[str]]]   # a line of text -> its sentences' tokens


def _whitespace(line: str) -> list[list[str]]:
    tokens = line.split()
    return [tokens] if tokens else []


def get_tokenizer(name: str) -> Tokenizer:
    """'whitespace': pre-tokenized text, a line is one sequence; 'raw': the project's raw-text tokenizer
    (tokenization/tokenizers.py: sentence splitting + Moses-style words), each sentence one sequence."""
    if name == "whitespace":
        return _whitespace
    if name == "raw":
        try:
            from elmo_pipeline.tokenization import tokenize_text
        except ImportError as e:
            raise RuntimeError(f"--tokenizer raw needs tokenization.tokenize_text, which cannot be imported ({e}); "
                               f"use --tokenizer whitespace for pre-tokenized text") from None
        return tokenize_text
    raise ValueError(f"unknown tokenizer {name!r} (whitespace or raw)")


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Paths, fsspec URLs and globs -> the matching files, sorted per pattern. Raises if one matches nothing, and
    at a local match that is no regular file (fsio.regular_file: a FIFO's open blocks, /dev/zero never ends)."""
    import fsspec

    from elmo_pipeline.fsio import is_local_url, regular_file
    out: list[str] = []
    for url in [urls] if isinstance(urls, str) else urls:
        files = fsspec.open_files(url, "rb")
        if not files:
            raise FileNotFoundError(f"no file matches {url!r}")
        for f in files:
            if is_local_url(url):
                regular_file(f.path)
        out.extend(f.full_name if "://" in url else f.path for f in files)
    return out


MAX_LINE_CHARS = 1 << 24      # a line (a sentence or paragraph) longer than this is refused, never read whole


def read_lines(urls: str | Sequence[str], tokenizer: Tokenizer = _whitespace) -> Iterator[list[str]]:
    """Token lists of every non-blank line (or sentence, per tokenizer) of every file
    (fsspec URLs and globs; .gz/.bz2/... decompressed by extension). ValueError naming the file and line for a
    line over MAX_LINE_CHARS (a few compressed bytes can hold gigabytes without a newline: fsio.bounded_lines) or
    text that is not UTF-8."""
    import fsspec
    for url in expand_urls(urls):
        with fsspec.open(url, "rt", encoding="utf-8", newline="\n", compression="infer") as f:
            try:
                for line in bounded_lines(f, MAX_LINE_CHARS, url):
                    for tokens in tokenizer(line):
                        if tokens:
                            yield tokens
            except UnicodeDecodeError as e:
                raise ValueError(f"{url}: not UTF-8 text ({e.reason} at byte {e.start} of a block)") from None


def build_vocabulary(counts: Counter, max_size: int | None = None, min_count: int = 1) -> Vocabulary:
    """<S> </S> <UNK>, then words by decreasing count (ties alphabetically): the order adaptive softmax needs."""
    words = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIALS), key=lambda w: (-counts[w], w))
    if max_size is not None:
        words = words[: max(0, max_size - len(SPECIALS))]
    return Vocabulary([*SPECIALS, *words])


@dataclass
class Corpus:
    """All windows of a corpus as flat arrays.

    types: distinct surface tokens (type 0 = <S>, 1 = </S>); type_ids / targets (N_tok,) int32 hold each
    window's input type and vocabulary id, <S>/</S> included; offsets (n_windows + 1,) int64.
    """
    types: list[str]
    type_ids: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray

    @property
    def n_windows(self) -> int:
        return len(self.offsets) - 1

    def digest(self) -> str:
        """SHA-256 of the windows as the model sees them (types, ids, targets, offsets): a run's training text,
        recorded in its checkpoints so that --resume continues on that text only."""
        import hashlib
        h = hashlib.sha256("\n".join(self.types).encode("utf-8"))
        for a in (self.type_ids, self.targets, self.offsets):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def n_predicted(self) -> int:
        """Tokens each direction predicts: all but one per window."""
        return int(self.lengths.sum() - self.n_windows)


def windows(lines: Iterable[list[str]], max_tokens: int) -> Iterator[list[str]]:
    for tokens in lines:
        for i in range(0, len(tokens), max_tokens):
            yield tokens[i: i + max_tokens]


def encode_corpus(lines: Iterable[list[str]], vocab: Vocabulary, max_tokens: int) -> Corpus:
    type_index = {BOS_TOKEN: 0, EOS_TOKEN: 1}
    type_ids: list[int] = []
    targets: list[int] = []
    offsets = [0]
    bos, eos = vocab.index[BOS_TOKEN], vocab.index[EOS_TOKEN]
    for w in windows(lines, max_tokens):
        type_ids.append(0)
        targets.append(bos)
        for t in w:
            type_ids.append(type_index.setdefault(t, len(type_index)))
        targets.extend(vocab.encode(w))
        type_ids.append(1)
        targets.append(eos)
        offsets.append(len(type_ids))
    return Corpus(list(type_index), np.asarray(type_ids, np.int32), np.asarray(targets, np.int32),
                  np.asarray(offsets, np.int64))


@dataclass
class Batch:
    """inputs (B, T, max_chars) char ids or (B, T) vocabulary ids, 0 where padded; lengths (B,);
    targets (B, T) vocabulary ids, 0 where padded. n_predicted: tokens each direction predicts."""
    inputs: torch.Tensor
    lengths: torch.Tensor
    targets: torch.Tensor

    @property
    def n_predicted(self) -> int:
        return int(self.lengths.sum() - len(self.lengths))


class BatchMaker:
    """Turns window indices into padded tensors, for a char-CNN or a word-embedding token encoder.

    Char ids are cut to the columns that can matter for the batch (its longest token + 2 word markers
    + `widest_filter`, at most max_chars): the columns cut are character padding, and every window of
    a filter that lies in them equals one all-padding window still kept, so the char CNN's max-pooled
    output is exactly the same as over all max_chars columns, at a fraction of the cost.
    """

    def __init__(self, corpus: Corpus, char_cnn: bool, max_chars: int = MAX_CHARS, widest_filter: int | None = None):
        self.corpus = corpus
        self.char_cnn = char_cnn
        self.max_chars = max_chars
        self.widest = widest_filter
        if char_cnn:   # row 0 = padding (all zeros), row k + 1 = type k
            table = np.zeros((len(corpus.types) + 1, max_chars), np.int64)
            for k, t in enumerate(corpus.types):
                table[k + 1] = token_char_ids(t, max_chars)
            self.char_table = torch.from_numpy(table)
            # columns used by each type: word markers + bytes (the special tokens use 3)
            self.type_width = torch.from_numpy(np.concatenate([[0], (table[1:] != 1 + 260).sum(axis=1)]))

    def __call__(self, window_ids: Sequence[int]) -> Batch:
        c = self.corpus
        lengths = np.array([c.offsets[i + 1] - c.offsets[i] for i in window_ids], np.int64)
        T = int(lengths.max())
        targets = np.zeros((len(window_ids), T), np.int64)
        types = np.zeros((len(window_ids), T), np.int64)
        for b, i in enumerate(window_ids):
            s, e = c.offsets[i], c.offsets[i + 1]
            targets[b, : e - s] = c.targets[s:e]
            types[b, : e - s] = c.type_ids[s:e] + 1
        targets_t = torch.from_numpy(targets)
        if self.char_cnn:
            types_t = torch.from_numpy(types)
            cols = self.max_chars
            if self.widest is not None:
                cols = min(cols, int(self.type_width[types_t].max()) + self.widest)
            inputs = self.char_table[:, :cols][types_t]
        else:
            inputs = targets_t.clone()
        return Batch(inputs, torch.from_numpy(lengths), targets_t)


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int, pool: int = 50) -> list[np.ndarray]:
    """The batches (arrays of window indices) of one epoch: shuffled, then sorted by length within pools of
    `pool` batches to cut padding, then the batch order shuffled. Deterministic in (seed, epoch).
    The last incomplete batch is dropped (every batch has exactly batch_size windows)."""
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    batches = []
    step = batch_size * pool
    for start in range(0, len(perm), step):
        chunk = perm[start: start + step]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        for b in range(0, len(chunk) - batch_size + 1, batch_size):
            batches.append(chunk[b: b + batch_size])
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def eval_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """All windows, length-sorted, in batches (the last may be smaller): for evaluation."""
    order = np.argsort(-lengths, kind="stable")
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def unigram_perplexity(train: Corpus, heldout: Corpus, vocab_size: int) -> float:
    """Perplexity of the add-one unigram model of `train` on `heldout`'s forward targets (w_1 .. </S>)."""
    counts = np.bincount(_forward_targets(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[_forward_targets(heldout)].mean()))


def _forward_targets(c: Corpus) -> np.ndarray:
    keep = np.ones(len(c.targets), bool)
    keep[c.offsets[:-1]] = False      # <S> is never a forward target
    return c.targets[keep]
