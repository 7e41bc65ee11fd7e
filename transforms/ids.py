"""Document ids: file labels (the id's file part), --id-field values, and the rule that an id names one record.
No Beam import.

Document ids: the id field when given, else "<file label>:<line or row number, 1-based>", where the file label
is the file's path relative to the deepest folder common to all inputs (file_labels).
"""
from __future__ import annotations

import posixpath
import re
from typing import Iterator

from elmo_pipeline.formats.layout import EXCERPT_CHARS, DeadLetter
from elmo_pipeline.fsio import redact
from elmo_pipeline.transforms.records import Document

JSON_TYPES = {type(None): "null", bool: "a boolean", float: "a number", list: "an array", dict: "an object"}
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def file_labels(files: list[str], root: str | None = None, full: bool = False) -> dict[str, str]:
    """file URL -> label. Default: its path relative to the deepest folder common to all files (a lone file:
    its name; redacted, so a presigned URL's signature is in no id). `root` (--id-root, a folder path or URL):
    its path relative to that folder; ValueError for a file outside it. `full`: the file's absolute path, or its
    URL for remote files (scheme kept). Labels from `root` and `full` never hold a URL's user info (credentials),
    query or fragment."""
    if root is not None:
        return {f: _label_under(f, root) for f in files}
    if full:
        return {f: public_url(f) for f in files}
    if len(files) == 1:
        return {files[0]: redact(posixpath.basename(files[0]))}
    common = posixpath.commonpath([f.split("://", 1)[-1] for f in files])
    return {f: redact(posixpath.relpath(f.split("://", 1)[-1], common)) for f in files}


def _place(url: str) -> tuple[str, str]:
    """(scheme, normalized path) of a file or folder: ("", absolute path) for local paths and file:// URLs;
    for remote URLs the bucket/host and path, without user info, query or fragment."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return "", posixpath.abspath(rest if sep else url)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    host, slash, path = rest.partition("/")
    return scheme, posixpath.normpath(host.rpartition("@")[2] + slash + path)


def public_url(url: str) -> str:
    """A file's absolute path, or its remote URL without user info, query or fragment."""
    scheme, path = _place(url)
    return f"{scheme}://{path}" if scheme else path


def _label_under(url: str, root: str) -> str:
    """The file's path relative to the folder `root`; ValueError when it is not under it."""
    (scheme, path), (root_scheme, root_path) = _place(url), _place(root)
    if scheme != root_scheme or not path.startswith(root_path.rstrip("/") + "/"):
        raise ValueError(f"--id-root {public_url(root)}: the input {public_url(url)} is not under it "
                         "(ids are the files' paths relative to --id-root)")
    return posixpath.relpath(path, root_path)


class BadId(ValueError):
    """An --id-field value that cannot be a document id; its message is the dead letter's reason."""


def document_id(value, id_field: str) -> str:
    """A document id from an --id-field value (JSONL field or Parquet cell): a string as it is, an integer
    (not a boolean) as its decimal digits; BadId ("bad id: ...") for anything else (null, boolean, number
    with a fraction or exponent, array, object, bytes), an empty string, or a string holding a C0/C1 control
    character (U+0000-U+001F, U+007F-U+009F: NUL ends an HDF5 name, the others are invisible). The same id
    names the document's sentences in Parquet and HDF5 ("<id>#<n>"; HDF5 escapes only '%' and '/')."""
    if isinstance(value, str):
        bad = _CONTROL.search(value)
        if bad:
            raise BadId(f"bad id: {id_field!r} holds the control character U+{ord(bad.group()):04X} at "
                        f"character {bad.start()}")
        if not value:
            raise BadId(f"bad id: {id_field!r} is an empty string")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    what = JSON_TYPES.get(type(value), type(value).__name__)
    raise BadId(f"bad id: {id_field!r} is {what} ({_short(value)}), not a string or an integer")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def printable_label(label: str) -> str:
    """A file label fit for ids and output text (strict UTF-8): a name that is not valid UTF-8 (Python holds
    its bad bytes as lone surrogates) gets each bad byte as a backslash escape, a\\xffb."""
    try:
        label.encode("utf-8")
        return label
    except UnicodeEncodeError:
        pass
    try:
        return label.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return label.encode("utf-8", "backslashreplace").decode("utf-8")


def split_duplicate_ids(doc_id: str, docs) -> Iterator[Document | DeadLetter]:
    """The documents that share one id: the document itself when it is alone; else a record dead letter
    "duplicate id" for each of them (by its source "<file>:<line>"), since ids must be unique (resume and
    HDF5 keys rely on them) and no copy is more right than another."""
    docs = sorted(docs, key=lambda d: d.source)
    if len(docs) == 1:
        yield docs[0]
        return
    where = ", ".join(d.source for d in docs[:5]) + (", ..." if len(docs) > 5 else "")
    for d in docs:
        yield DeadLetter(d.source or doc_id, f"duplicate id: {len(docs)} records have the id {doc_id!r} "
                         f"(--id-field): {where}", d.text[:EXCERPT_CHARS], level="record")
