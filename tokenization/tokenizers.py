"""Sentence splitting and word tokenization with character offsets. No Beam or torch import.

wikitext    sentences by blingfire (FSM, C, deterministic, offline), words by sacremoses' port of the
            Moses tokenizer, aggressive hyphen splits as WikiText ("well-known" -> well @-@ known): the
            scheme of the shipped WikiText-2 model. Offsets come from aligning each token to the source
            text; "@-@" maps to its "-".
moses       the same sentences and Moses tokens without the hyphen splits ("well-known" stays whole): the
            scheme of the 1B Word Benchmark the published ELMo models were trained on.
raw         the scheme of the model's training text (model.pretrained: TOKENIZATION of each model):
            resolved to wikitext or moses by resolve_tokenizer(); wikitext when no model says otherwise.
whitespace  pre-tokenized text: the whole record is one sentence, tokens split on whitespace.

Offsets are [start, end) indices into the document string (Python code points).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

TOKENIZERS = ("raw", "wikitext", "moses", "whitespace")
RAW_SCHEMES = ("wikitext", "moses")      # what `raw` can stand for: the training-text schemes of models
DEFAULT_RAW = "wikitext"
TOKENIZER_VERSION = "1"   # raised whenever a tokenizer here splits any text differently (model.resolve key_prefix)
_WS = re.compile(r"\S+")
_SOURCE_FORM = {"@-@": "-", "@,@": ",", "@.@": "."}
PROTECTED = [r"<unk>"]   # WikiText's unknown-word marker stays one token


@dataclass(frozen=True)
class Sentence:
    """One sentence of a document: tokens and their [start, end) character offsets in the document."""
    tokens: tuple[str, ...]
    offsets: tuple[tuple[int, int], ...]


@lru_cache(maxsize=1)
def _moses():
    import sacremoses
    return sacremoses.MosesTokenizer("en")


_PROTECTED_RE = re.compile("|".join(PROTECTED), re.IGNORECASE)


def tokenizer_version(mode: str) -> str:
    """The version of a tokenizer's output: TOKENIZER_VERSION, and sacremoses' for moses."""
    if mode != "moses":
        return TOKENIZER_VERSION
    from importlib.metadata import version
    return f"{TOKENIZER_VERSION}, sacremoses {version('sacremoses')}"


def resolve_tokenizer(mode: str, model_scheme: str | None = None) -> str:
    """The concrete tokenizer for a --tokenizer value: `raw` -> the model's scheme (wikitext or moses;
    DEFAULT_RAW if None), anything else as given."""
    if mode not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {mode!r}")
    if mode != "raw":
        return mode
    scheme = model_scheme or DEFAULT_RAW
    if scheme not in RAW_SCHEMES:
        raise ValueError(f"a model's tokenization must be one of {RAW_SCHEMES}, got {scheme!r}")
    return scheme


def moses_tokens(text: str, dash_splits: bool = True) -> list[str]:
    """Moses tokens of one sentence (escape off, <unk> kept whole; hyphens split as @-@ if dash_splits).

    sacremoses refuses a text with more than MAX_PROTECTED_TOKENS (1000) protected matches: such a text
    is tokenized in pieces cut at whitespace, each with at most that many."""
    moses = _moses()
    limit = getattr(moses, "MAX_PROTECTED_TOKENS", None)
    if limit:
        starts = [m.start() for m in _PROTECTED_RE.finditer(text)]
        if len(starts) > limit:
            cuts = [0]
            for at in starts[limit::limit]:
                ws = max(text.rfind(" ", cuts[-1], at), text.rfind("\t", cuts[-1], at))
                cuts.append(ws + 1 if ws > cuts[-1] else at)
            cuts.append(len(text))
            return [t for a, b in zip(cuts, cuts[1:]) for t in moses_tokens(text[a:b], dash_splits)]
    return moses.tokenize(text, escape=False, aggressive_dash_splits=dash_splits, protected_patterns=PROTECTED)


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) code-point spans of blingfire's sentences: blingfire.text_to_sentences_and_offsets's
    spans exactly, with its byte-to-character offset mapping done by numpy instead of a Python loop over
    every byte of the text (the loop cost more than the splitting itself)."""
    import ctypes

    import blingfire
    import numpy as np
    if not text.strip():
        return []
    raw = text.encode("utf-8")
    size = 2 * len(raw)
    out, starts, ends = ctypes.create_string_buffer(size), (ctypes.c_int32 * size)(), (ctypes.c_int32 * size)()
    n = blingfire.blingfire.TextToSentencesWithOffsets(ctypes.c_char_p(raw), ctypes.c_int(len(raw)), ctypes.byref(out),
                                                       ctypes.byref(starts), ctypes.byref(ends), ctypes.c_int(size))
    if n == -1 or n > size:
        return []
    k = out.value.count(b"\n") + 1
    lead = (np.frombuffer(raw, dtype=np.uint8) & 0xC0) != 0x80          # the first byte of each code point
    before = np.concatenate([[0], np.cumsum(lead)])                      # code points before byte u
    bounds = np.empty(2 * k, dtype=np.int64)
    bounds[0::2] = np.frombuffer(starts, dtype=np.int32, count=k)
    bounds[1::2] = np.frombuffer(ends, dtype=np.int32, count=k) + 1     # blingfire's ends are inclusive
    at_end = bounds == len(raw)
    on_char = np.append(lead, True)[np.clip(bounds, 0, len(raw))] & (bounds >= 0)
    if not (on_char.all() and (np.diff(bounds) >= 0).all() and not at_end[:-1].any()):
        _, spans = blingfire.text_to_sentences_and_offsets(text)    # offsets off code-point starts: its own rules
        return [(int(a), int(b)) for a, b in spans]
    mapped = before[bounds].tolist()
    return list(zip(mapped[0::2], mapped[1::2]))


def _is_junk(ch: str) -> bool:
    """Characters Moses deletes (its ASCII_JUNK, U+0000..U+001F) or turns into token breaks (whitespace)."""
    return ch.isspace() or ch < "\x20"


def _match_with_junk(text: str, form: str, i: int) -> int:
    """End of `form` matched at `i`, allowing deleted control characters between its characters; -1 if none."""
    n = len(text)
    for ch in form:
        while i < n and text[i] != ch and text[i] < "\x20":
            i += 1
        if i >= n or text[i] != ch:
            return -1
        i += 1
    return i


def align_tokens(text: str, tokens: list[str], start: int = 0) -> list[tuple[int, int]]:
    """[start, end) of each token in `text`, searching forward from `start` past whitespace only.

    A token that Moses built by deleting control characters (U+0000..U+001F, e.g. NUL) spans the
    source text it came from, deleted characters included. A token that is not found (after another
    Moses rewrite) gets the empty span at the cursor. Linear in the text's length."""
    offsets, cursor, n = [], start, len(text)
    for tok in tokens:
        form = _SOURCE_FORM.get(tok, tok)
        at = cursor
        while at < n and text[at].isspace():
            at += 1
        if text.startswith(form, at):
            end = at + len(form)
        else:                                   # rare: control characters deleted around or inside it
            at = cursor
            while at < n and _is_junk(text[at]) and text[at] != form[:1]:
                at += 1
            end = _match_with_junk(text, form, at)
            if end < 0:
                offsets.append((cursor, cursor))
                continue
        offsets.append((at, end))
        cursor = end
    return offsets


def tokenize_document(text: str, mode: str = "raw", split_sentences: bool = True) -> list[Sentence]:
    """Sentences of one document, each with tokens and character offsets into `text`. mode: a TOKENIZERS
    value (raw: DEFAULT_RAW; resolve it with resolve_tokenizer() to follow a model).

    split_sentences=False: the whole text is one sentence (input format `lines`)."""
    mode = resolve_tokenizer(mode)
    if mode == "whitespace":
        spans = [(m.start(), m.end()) for m in _WS.finditer(text)]
        return [Sentence(tuple(text[s:e] for s, e in spans), tuple(spans))] if spans else []
    dash_splits = mode == "wikitext"
    out = []
    spans = _sentence_spans(text) if split_sentences else ([(0, len(text))] if text.strip() else [])
    for s, e in spans:
        tokens = moses_tokens(text[s:e], dash_splits)
        if tokens:
            offsets = align_tokens(text, tokens, s)
            out.append(Sentence(tuple(tokens), tuple(offsets)))
    return out


def tokenize_text(text: str, mode: str = "raw", split_sentences: bool = True) -> list[list[str]]:
    """Sentences of `text` as token lists (no offsets): the tokenizer the pipeline uses."""
    return [list(s.tokens) for s in tokenize_document(text, mode, split_sentences)]
