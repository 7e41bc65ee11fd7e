"""ELMo character ids, exactly as bilm-tf's Batcher / AllenNLP's ELMoCharacterMapper make them.

A token becomes `max_chars` (50) ids: beginning-of-word, its UTF-8 bytes (truncated to
max_chars - 2 bytes), end-of-word, then padding. Every id is shifted by +1 so that 0 can mean
"no token here" (a padded position); the char embedding gets a matching all-zero row 0.
The sentence-boundary tokens <S> and </S> have their own ids (256 / 257 between the word markers).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

MAX_CHARS = 50
BOS_CHAR, EOS_CHAR = 256, 257   # begin / end of sentence
BOW_CHAR, EOW_CHAR = 258, 259   # begin / end of word
PAD_CHAR = 260
BOS_TOKEN, EOS_TOKEN = "<S>", "</S>"


def _marker_ids(char: int, max_chars: int) -> np.ndarray:
    ids = np.full(max_chars, PAD_CHAR, dtype=np.int64)
    ids[:3] = (BOW_CHAR, char, EOW_CHAR)
    return ids + 1


def token_char_ids(token: str, max_chars: int = MAX_CHARS) -> np.ndarray:
    """(max_chars,) int64 ids of one token, +1 shifted (never 0)."""
    if token == BOS_TOKEN:
        return _marker_ids(BOS_CHAR, max_chars)
    if token == EOS_TOKEN:
        return _marker_ids(EOS_CHAR, max_chars)
    # errors="surrogatepass": lone surrogates (possible in decoded dirty text) still become bytes.
    raw = token.encode("utf-8", "surrogatepass")[: max_chars - 2]
    ids = np.full(max_chars, PAD_CHAR, dtype=np.int64)
    ids[0] = BOW_CHAR
    ids[1:1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    ids[1 + len(raw)] = EOW_CHAR
    return ids + 1


def sentence_char_ids(tokens: Sequence[str], max_chars: int = MAX_CHARS, *, add_boundaries: bool = True) -> np.ndarray:
    """(T [+2], max_chars) ids of a sentence, with <S> ... </S> around it by default."""
    toks = [BOS_TOKEN, *tokens, EOS_TOKEN] if add_boundaries else list(tokens)
    out = np.empty((len(toks), max_chars), dtype=np.int64)
    for i, t in enumerate(toks):
        out[i] = token_char_ids(t, max_chars)
    return out


def _rows(tokens: Sequence[str], max_chars: int) -> np.ndarray:
    """(U, max_chars) int64 ids of distinct tokens, as token_char_ids gives them, built in one vectorized step."""
    raw = [t.encode("utf-8", "surrogatepass")[: max_chars - 2] for t in tokens]
    lens = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
    out = np.full((len(raw), max_chars), PAD_CHAR + 1, dtype=np.int64)
    out[:, 0] = BOW_CHAR + 1
    ends = np.cumsum(lens)
    row = np.repeat(np.arange(len(raw)), lens)
    col = 1 + np.arange(int(ends[-1]) if len(raw) else 0) - np.repeat(ends - lens, lens)
    out[row, col] = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.int64) + 1
    out[np.arange(len(raw)), lens + 1] = EOW_CHAR + 1
    for i, t in enumerate(tokens):
        if t in (BOS_TOKEN, EOS_TOKEN):
            out[i] = token_char_ids(t, max_chars)
    return out


def distinct_char_ids(sentences: Sequence[Sequence[str]], max_chars: int = MAX_CHARS,
                      *, add_boundaries: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch as its distinct token rows and an index into them:
    uniq (U, max_chars) int64, each row once, sorted as torch.unique(dim=0) sorts them (lexicographically);
    index (B, T_max [+2]) int64 into uniq, -1 at padded positions; lengths (B,).
    Python touches each token once (a dict lookup); the rows are built per distinct token."""
    vocab: dict[str, int] = {BOS_TOKEN: 0, EOS_TOKEN: 1} if add_boundaries else {}
    ids = np.fromiter((vocab.setdefault(t, len(vocab)) for s in sentences for t in s), dtype=np.int64)
    n = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
    extra = 2 if add_boundaries else 0
    lengths = n + extra
    width = int(lengths.max(initial=0))
    index = np.full((len(sentences), width), -1, dtype=np.int64)
    first = 1 if add_boundaries else 0
    b = np.repeat(np.arange(len(sentences)), n)
    j = np.arange(len(ids)) - np.repeat(np.cumsum(n) - n, n)
    rows = _rows(list(vocab), max_chars)
    uniq, inverse = np.unique(rows, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    index[b, first + j] = inverse[ids]
    if add_boundaries and len(sentences):
        index[:, 0] = inverse[0]
        index[np.arange(len(sentences)), lengths - 1] = inverse[1]
    return uniq, index, lengths


def batch_char_ids(sentences: Sequence[Sequence[str]], max_chars: int = MAX_CHARS,
                   *, add_boundaries: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Pad a batch: ids (B, T_max [+2], max_chars) int64 with 0 at padded positions, lengths (B,)."""
    uniq, index, lengths = distinct_char_ids(sentences, max_chars, add_boundaries=add_boundaries)
    table = np.concatenate([np.zeros((1, max_chars), dtype=np.int64), uniq])
    return table[index + 1], lengths
