"""Reading documents from text, JSONL and Parquet files (local paths or fsspec URLs). No Beam import.

Document ids: the id field when given, else "<file label>:<line or row number, 1-based>", where the
file label is the file's path relative to the deepest folder common to all inputs.
Compression (.gz, .bz2, .zst, .xz) is inferred from the file name.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Iterator

import fsspec

INPUT_FORMATS = ("text", "lines", "jsonl", "parquet")
EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Document:
    """A document's id and text; `split_sentences` False means the record is one sentence."""
    doc_id: str
    text: str
    split_sentences: bool = True


@dataclass(frozen=True)
class DeadLetter:
    """A record or sentence that could not be embedded: id, reason, the first characters of it."""
    id: str
    reason: str
    excerpt: str

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "reason": self.reason, "excerpt": self.excerpt}, ensure_ascii=False)


def expand_inputs(patterns: list[str], storage_options: dict | None = None) -> list[str]:
    """Sorted, de-duplicated file URLs matching the patterns. A pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        fs, _, paths = fsspec.get_fs_token_paths(pattern, storage_options=_opts(pattern, storage_options))
        found = [p for p in paths if fs.isfile(p)]
        if not found:
            raise FileNotFoundError(f"input {pattern!r} matches no file")
        files += [fs.unstrip_protocol(p) if "://" in pattern else p for p in found]
    return sorted(set(files))


def file_labels(files: list[str]) -> dict[str, str]:
    """file URL -> label: its path relative to the deepest folder common to all files."""
    if len(files) == 1:
        return {files[0]: posixpath.basename(files[0])}
    common = posixpath.commonpath([f.split("://", 1)[-1] for f in files])
    return {f: posixpath.relpath(f.split("://", 1)[-1], common) for f in files}


def _opts(url: str, storage_options: dict | None) -> dict:
    """fsspec storage options for `url`'s protocol out of {protocol: {...}}."""
    proto = url.split("://", 1)[0] if "://" in url else "file"
    return dict((storage_options or {}).get(proto, {}))


def read_documents(url: str, fmt: str, label: str, text_field: str = "text", id_field: str | None = None,
                   storage_options: dict | None = None) -> Iterator[Document | DeadLetter]:
    """Documents of one file, in file order; blank records are skipped, bad ones are dead letters."""
    if fmt not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {INPUT_FORMATS}, got {fmt!r}")
    opts = _opts(url, storage_options)
    if fmt == "parquet":
        yield from _read_parquet(url, label, text_field, id_field, opts)
        return
    with fsspec.open(url, "rt", encoding="utf-8", newline="\n", compression="infer", **opts) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n").rstrip("\r")
            default_id = f"{label}:{n}"
            if fmt in ("text", "lines"):
                if line.strip():
                    yield Document(default_id, line, split_sentences=(fmt == "text"))
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[text_field]
                if not isinstance(text, str):
                    raise TypeError(f"field {text_field!r} is {type(text).__name__}, not a string")
                doc_id = str(record[id_field]) if id_field else default_id
            except (ValueError, KeyError, TypeError) as e:
                yield DeadLetter(default_id, f"unreadable record: {type(e).__name__}: {e}", line[:EXCERPT_CHARS])
                continue
            if text.strip():
                yield Document(doc_id, text)


def _read_parquet(url, label, text_field, id_field, opts) -> Iterator[Document | DeadLetter]:
    import pyarrow.parquet as pq
    with fsspec.open(url, "rb", **opts) as f:
        pf = pq.ParquetFile(f)
        columns = [text_field] + ([id_field] if id_field else [])
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise ValueError(f"{url}: no column(s) {missing} (has {pf.schema_arrow.names})")
        n = 0
        for batch in pf.iter_batches(columns=columns, batch_size=4096):
            texts = batch.column(0).to_pylist()
            ids = batch.column(1).to_pylist() if id_field else [None] * len(texts)
            for text, doc_id in zip(texts, ids):
                n += 1
                rid = f"{label}:{n}" if doc_id is None else str(doc_id)
                if text is None or not isinstance(text, str):
                    yield DeadLetter(rid, f"unreadable record: {text_field!r} is null or not a string", repr(text)[:EXCERPT_CHARS])
                elif text.strip():
                    yield Document(rid, text)
