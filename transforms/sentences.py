"""A document's tokenizer result as Items and dead letters: the plain part of the Tokenize step. No Beam import.

Every document gives at least one sentence: one whose text has no tokens at all (only control characters,
say), that the tokenizer fails on, or whose sentences hold more than max_document_tokens tokens in all, is
dead-lettered as its sentence #0; a sentence over max_tokens is dead-lettered alone.
"""
from __future__ import annotations

from typing import Iterator

from elmo_pipeline.formats.layout import EXCERPT_CHARS, DeadLetter, sentence_id
from elmo_pipeline.model.resolve import sentence_key
from elmo_pipeline.transforms.progress import split_bytes
from elmo_pipeline.transforms.records import Document, Item


def document_reason(sentences, max_document_tokens: int) -> str | None:
    """Why a document's tokenize_or_reason() result (its sentences, or the tokenizer's error) is one dead
    letter, its sentence #0: the tokenizer failed, no tokens, or more tokens than max_document_tokens. None: fine."""
    if isinstance(sentences, str):
        return f"tokenizer failed: {sentences}"[:500]
    if not sentences:
        return "no tokens: the text has no tokens (only control, format or other characters the tokenizer drops)"
    total = sum(len(s.tokens) for s in sentences)
    if total > max_document_tokens:
        return f"too long: document of {total} tokens > --max-document-tokens {max_document_tokens}"
    return None


def sentence_items(doc: Document, sentences, max_tokens: int, max_document_tokens: int,
                   limit_flag: str = "--max-sentence-tokens", share_bytes: bool = False, key_prefix: str | None = None
                   ) -> Iterator[tuple[Item | DeadLetter, int]]:
    """(Item or DeadLetter, its input bytes) per sentence of `doc`, from tokenize_or_reason()'s result
    (`sentences`); a document that is one dead letter (document_reason) gives only that, with all its bytes.
    share_bytes: the document's bytes are shared out between its sentences (transforms.progress.split_bytes),
    else each sentence has 0. key_prefix: each Item carries its sentence key (model.resolve.sentence_key)."""
    reason = document_reason(sentences, max_document_tokens)
    if reason:
        yield DeadLetter(sentence_id(doc.doc_id, 0), reason, doc.text[:EXCERPT_CHARS]), doc.nbytes
        return
    shares = split_bytes(doc.nbytes, [s.offsets[-1][1] if s.offsets else 0 for s in sentences], len(doc.text)) \
        if share_bytes else [0] * len(sentences)
    for i, (s, nbytes) in enumerate(zip(sentences, shares)):
        sid = sentence_id(doc.doc_id, i)
        if len(s.tokens) > max_tokens:
            start, end = s.offsets[0][0], s.offsets[-1][1]
            yield DeadLetter(sid, f"too long: {len(s.tokens)} tokens > {limit_flag} {max_tokens}",
                             doc.text[start:end][:EXCERPT_CHARS]), nbytes
            continue
        key = sentence_key(key_prefix, s.tokens) if key_prefix else ""
        yield Item(sid, doc.doc_id, i, s.tokens, s.offsets, nbytes, key=key), nbytes
