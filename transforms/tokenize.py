"""Sentence splitting and word tokenization with character offsets. No Beam import.

raw         sentences by blingfire (FSM, C, deterministic, offline), words by sacremoses' port of the
            Moses tokenizer (the scheme of WikiText and the 1B Word Benchmark ELMo was trained on),
            aggressive hyphen splits as WikiText ("well-known" -> well @-@ known). Offsets come from
            aligning each token to the source text; "@-@" maps to its "-".
whitespace  pre-tokenized text: the whole record is one sentence, tokens split on whitespace.

Offsets are [start, end) indices into the document string (Python code points).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

TOKENIZERS = ("raw", "whitespace")
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


def moses_tokens(text: str) -> list[str]:
    """Moses tokens of one sentence (escape off, hyphens split as @-@, <unk> kept whole)."""
    return _moses().tokenize(text, escape=False, aggressive_dash_splits=True, protected_patterns=PROTECTED)


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    import blingfire
    if not text.strip():
        return []
    _, spans = blingfire.text_to_sentences_and_offsets(text)
    return [(int(s), int(e)) for s, e in spans]


def align_tokens(text: str, tokens: list[str], start: int = 0) -> list[tuple[int, int]]:
    """[start, end) of each token in `text`, searching forward from `start`.

    A token that is not found verbatim (after a Moses rewrite) gets the empty span at the cursor."""
    offsets, cursor = [], start
    for tok in tokens:
        form = _SOURCE_FORM.get(tok, tok)
        at = text.find(form, cursor)
        if at < 0 or text[cursor:at].strip():  # not found, or only after skipping non-space text
            offsets.append((cursor, cursor))
            continue
        offsets.append((at, at + len(form)))
        cursor = at + len(form)
    return offsets


def tokenize_document(text: str, mode: str = "raw", split_sentences: bool = True) -> list[Sentence]:
    """Sentences of one document, each with tokens and character offsets into `text`.

    split_sentences=False: the whole text is one sentence (input format `lines`)."""
    if mode == "whitespace":
        spans = [(m.start(), m.end()) for m in _WS.finditer(text)]
        return [Sentence(tuple(text[s:e] for s, e in spans), tuple(spans))] if spans else []
    if mode != "raw":
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {mode!r}")
    out = []
    spans = _sentence_spans(text) if split_sentences else ([(0, len(text))] if text.strip() else [])
    for s, e in spans:
        tokens = moses_tokens(text[s:e])
        if tokens:
            offsets = align_tokens(text, tokens, s)
            out.append(Sentence(tuple(tokens), tuple(offsets)))
    return out


def tokenize_text(text: str, mode: str = "raw", split_sentences: bool = True) -> list[list[str]]:
    """Sentences of `text` as token lists (no offsets): the tokenizer the pipeline uses."""
    return [list(s.tokens) for s in tokenize_document(text, mode, split_sentences)]
