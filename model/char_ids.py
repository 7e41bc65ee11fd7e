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


def batch_char_ids(sentences: Sequence[Sequence[str]], max_chars: int = MAX_CHARS,
                   *, add_boundaries: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Pad a batch: ids (B, T_max [+2], max_chars) int64 with 0 at padded positions, lengths (B,)."""
    per = [sentence_char_ids(s, max_chars, add_boundaries=add_boundaries) for s in sentences]
    lengths = np.array([len(p) for p in per], dtype=np.int64)
    out = np.zeros((len(per), int(lengths.max(initial=0)), max_chars), dtype=np.int64)
    for b, p in enumerate(per):
        out[b, : len(p)] = p
    return out, lengths
