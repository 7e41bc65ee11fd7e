"""Document ids: file labels (the id's file part), --id-field values, and the rule that an id names one record.
No Beam import.

Document ids: the id field when given, else "<file label>:<line or row number, 1-based>", where the file label
is the file's path relative to the deepest folder common to all inputs (file_labels). Distinct inputs get
distinct labels; one file however spelled (x.txt, ./x.txt, file:///abs/x.txt: fsio.expand) gets one.
"""
from __future__ import annotations

import hashlib
import posixpath
import re
from typing import Iterator

from elmo_pipeline.formats.layout import EXCERPT_CHARS, DeadLetter
from elmo_pipeline.fsio import redact
from elmo_pipeline.fsio.fs import RESOLVED_PATHS, normalise
from elmo_pipeline.fsio.redact import redact_url_part, secret_name
from elmo_pipeline.transforms.records import Document

JSON_TYPES = {type(None): "null", bool: "a boolean", float: "a number", list: "an array", dict: "an object"}
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_ESCAPED = re.compile("[\\\\\x00-\x1f\x7f-\x9f\ud800-\udfff]")   # what escape_label writes as a backslash escape
_DIGEST_CHARS = 16                 # hex digits of the digest that tells apart inputs whose labels coincide


def file_labels(files: list[str], root: str | None = None, full: bool = False) -> dict[str, str]:
    """file URL -> label. Default: its path relative to the deepest folder common to all files (a lone file:
    its name), with its query string; redacted, so a presigned URL's signature is in no id. `root` (--id-root, a
    folder path or URL): its path relative to that folder; ValueError for a file outside it. `full`: the file's
    absolute path, or its URL for remote files (scheme kept). Labels from `root` and `full` never hold a URL's
    user info (credentials), query or fragment.

    Every label is escaped (escape_label), and labels that still coincide for distinct inputs (a query dropped
    or masked, a redacted name) end in "~" and a digest of each input's identity (_identity: no secret in it)."""
    if root is not None:
        labels = {f: _label_under(f, root) for f in files}
    elif full:
        labels = {f: public_url(f) for f in files}
    else:
        labels = _relative_labels(files)
    # a remote URL's label is redacted as its URL would be (a presigned URL's signature is in no id, a space in it
    # included); a local name is the file's own name, whatever it holds ("page?id=3.html" has no query)
    hide = redact if full else redact_url_part
    return _distinct({f: escape_label(hide(label) if _place(f)[0] else label) for f, label in labels.items()})


def _relative_labels(files: list[str]) -> dict[str, str]:
    """file URL -> its path (after the scheme) relative to the deepest folder common to all files' folders, or a
    lone file's name, then its query string as it is."""
    split = {f: _path_and_query(f) for f in files}
    if len(files) == 1:
        return {f: posixpath.basename(path) + query for f, (path, query) in split.items()}
    try:
        common = posixpath.commonpath([posixpath.dirname(path) for path, _ in split.values()])
    except ValueError:            # local paths beside remote ones: no folder in common
        common = ""
    return {f: (posixpath.relpath(path, common) if common else path) + query for f, (path, query) in split.items()}


def _path_and_query(url: str) -> tuple[str, str]:
    """(what follows the scheme up to the query, without user info; the query string from its '?', without the
    URL's fragment); a local path has no query."""
    rest = url.split("://", 1)[-1]
    if "://" not in url or url.startswith("file://"):
        return rest, ""
    rest = rest.partition("#")[0]              # a fragment is never sent, and may hold a token: in no id
    path, mark, query = rest.partition("?")
    host, slash, path = path.partition("/")
    return host.rpartition("@")[2] + slash + path, mark + query


def _distinct(labels: dict[str, str]) -> dict[str, str]:
    """The labels, each that coincides with another file's ending in "~<digest of the file's identity>" (and
    "-<n>" among URLs of one identity: they differ in their secrets only), until none coincide. Spellings of one
    file (a path and its file:// URL) keep one label."""
    spelling = {f: normalise(public_url(f) if not _place(f)[0] else f) for f in labels}
    named: dict[str, list[str]] = {}         # identity -> its spellings, in sort order
    for s in sorted(set(spelling.values())):
        named.setdefault(_identity(s), []).append(s)
    suffix = {s: "~" + hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
              + (f"-{n}" if len(spellings) > 1 else "") for identity, spellings in named.items()
              for n, s in enumerate(spellings, 1)}
    tied: set[str] = set()
    while True:
        out = {f: label + suffix[spelling[f]] if spelling[f] in tied else label for f, label in labels.items()}
        files_of: dict[str, set[str]] = {}
        for f, label in out.items():
            files_of.setdefault(label, set()).add(spelling[f])
        more = set().union(*(s for s in files_of.values() if len(s) > 1)) - tied
        if not more:
            return out
        tied |= more


def _identity(url: str) -> str:
    """What makes an input a file of its own: its absolute path, or its URL without the user info's password and
    with the values of its query's credential parameters (redact.secret_name) left out."""
    scheme, path = _place(url)
    if not scheme:
        return path
    rest = url.split("://", 1)[1].split("#", 1)[0]
    authority = rest.partition("/")[0]
    user = authority.rpartition("@")[0].partition(":")[0] if "@" in authority else ""
    query = rest.partition("?")[2]
    kept = "&".join(p.partition("=")[0] + "=" if secret_name(p.partition("=")[0]) else p
                    for p in query.split("&")) if query else ""
    return f"{scheme}://{user + '@' if user else ''}{path}{'?' + kept if query else ''}"


def _place(url: str) -> tuple[str, str]:
    """(scheme, normalized path) of a file or folder: ("", absolute path) for local paths and file:// URLs;
    for remote URLs the bucket/host and path, without user info, query or fragment (an object store's key as it is:
    fsio.fs.normalise)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return "", posixpath.abspath(rest if sep else url)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    host, slash, path = rest.partition("/")
    place = host.rpartition("@")[2] + slash + path
    return scheme, posixpath.normpath(place) if scheme in RESOLVED_PATHS else place     # a key: as it is


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


def escape_label(text: str) -> str:
    """`text` with each character that would make a label unprintable, or two labels alike, as a backslash
    escape, so that distinct texts stay distinct (reversibly): a backslash as \\\\, a C0 control or DEL as
    \\xHH, a C1 control as \\u00HH, a byte that is not UTF-8 (a file name's, held by Python as a lone surrogate
    U+DC80-U+DCFF) as \\xHH of that byte (80-FF), another lone surrogate as \\uHHHH. Other text is as it is."""
    return _ESCAPED.sub(_escape, text)


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    if code == 0x5C:
        return "\\\\"
    if code < 0x80 or 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code & 0xFF:02x}"
    return f"\\u{code:04x}"


def printable_label(label: str) -> str:
    """A file label fit for ids and output text (strict UTF-8): as it is when it is (file_labels' labels are),
    else escape_label's, so that a name's bytes that are not UTF-8 read as a\\xffb."""
    try:
        label.encode("utf-8")
        return label
    except UnicodeEncodeError:
        return escape_label(label)


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
