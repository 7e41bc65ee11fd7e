"""What a reader checks before it trusts an output's files: manifest paths inside the output, each shard's
schema, dtype, widths and counts against the manifest, Arrow dictionaries and their codes, HDF5 shapes.
No Beam import.

Cheap checks run on every open (per sentence or per column, never per float); `full=True` adds pyarrow's
full validation of every Arrow buffer (ElmoOutput.validate). A failed check raises DamagedOutput naming the
file; a reader never follows a path out of the output, never allocates more than the manifest implies.
"""
from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from elmo_pipeline.formats.layout import recorded_files
from elmo_pipeline.formats.parquet import META_COLUMNS, TOKEN_META_COLUMNS
from elmo_pipeline.fsio import is_local_fs, redact, same_digest
from elmo_pipeline.output.manifest import is_file_record


class DamagedOutput(ValueError):
    """A file of an output that does not match its manifest (or a manifest naming a file outside the output). Its
    message is redacted (fsio.redact: a URL's password, token or signature never in it)."""

    def __init__(self, message: str):
        super().__init__(redact(message))


def inside_path(where: str, rel) -> str:
    """rel, a manifest's file name, when it is a relative path that stays inside the output folder."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or "\\" in rel or ":" in rel.split("/")[0] \
            or any(part in ("..", ".", "") for part in rel.split("/")):
        raise DamagedOutput(f"{where}: file name {rel!r} is not a relative path inside the output")
    return posixpath.normpath(rel)


MAX_WIDTH = 1 << 16             # the widest layer a manifest may declare (the original biLM's is 1,024)
META_NAMES = {*META_COLUMNS, *TOKEN_META_COLUMNS, "token_offsets"}     # no layer may be named as these


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def checked_header(where: str, manifest: dict) -> tuple[list[str], dict[str, int], list[str], str]:
    """(layer names, {name: stored width}, formats, parquet layout) of a manifest, checked: distinct layer names
    that are no metadata column, each with an int width of 1 to MAX_WIDTH, every width the widest or half of it
    (layer 0 stored P wide); formats a list of names; the Parquet layout "sentence" or "token"."""
    names, dims = manifest.get("layers"), manifest.get("layer_dims")
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n and n not in META_NAMES for n in names)
            and len(set(names)) == len(names)):
        raise DamagedOutput(f"{where}: layers {_shown(names)} is not a list of distinct layer names")
    if not (isinstance(dims, dict) and set(dims) == set(names)
            and all(type(d) is int and 0 < d <= MAX_WIDTH for d in dims.values())):
        raise DamagedOutput(f"{where}: layer_dims {_shown(dims)} is not a width of 1 to {MAX_WIDTH} for each "
                            f"layer of {names}")
    widest = max(dims.values())
    if any(d != widest and 2 * d != widest for d in dims.values()):
        raise DamagedOutput(f"{where}: layer_dims {_shown(dims)}: a width neither the widest nor half of it")
    formats = manifest.get("formats", [])
    if not (isinstance(formats, list) and all(isinstance(f, str) for f in formats)):
        raise DamagedOutput(f"{where}: formats {_shown(formats)} is not a list of format names")
    layout = manifest.get("parquet_layout", "sentence")
    if layout not in ("sentence", "token"):
        raise DamagedOutput(f"{where}: parquet_layout {_shown(layout)} is neither sentence nor token")
    return names, {n: dims[n] for n in names}, formats, layout


def check_parquet_schema(schema: pa.Schema, where: str, layer_dims: Mapping[str, int], dtype: str,
                         layout: str) -> None:
    """Raise DamagedOutput unless a Parquet shard's schema has the layout's metadata columns and each layer of
    `layer_dims` as that many `dtype` floats a token (a list of them a row in the sentence layout)."""
    meta = META_COLUMNS if layout == "sentence" else TOKEN_META_COLUMNS
    for col in (*meta, *layer_dims):
        if schema.get_field_index(col) < 0:
            raise DamagedOutput(f"{where}: no column {col!r}")
    want = pa.float16() if dtype == "float16" else pa.float32()
    for name, width in layer_dims.items():
        t = schema.field(name).type
        row = t.value_type if layout == "sentence" and pa.types.is_list(t) else t
        if (layout == "sentence" and not pa.types.is_list(t)) or not pa.types.is_fixed_size_list(row) \
                or row.value_type != want or row.list_size != width:
            shape = f"list<fixed_size_list<{want}>[{width}]>" if layout == "sentence" else \
                f"fixed_size_list<{want}>[{width}]"
            raise DamagedOutput(f"{where}: column {name} is {t}, the manifest says {shape}")


def check_parquet_counts(meta, where: str, sentences: int, tokens: int, layer_dims: Mapping[str, int],
                         layout: str) -> None:
    """Raise DamagedOutput unless a Parquet shard's footer (pyarrow FileMetaData) counts what its manifest entry
    says: a row a sentence (a token in the token layout), and each layer's `tokens x width` values (the sentence
    layout's `tokens` column: `tokens` words; an empty list may count one more). Checked before any page is read:
    a shard with fewer sentences is refused, not read short, and no read decodes more values than the manifest
    counts (a page holding more than its footer says fails as it decodes)."""
    rows = sentences if layout == "sentence" else tokens
    if meta.num_rows != rows:
        raise DamagedOutput(f"{where}: {meta.num_rows} rows, the manifest says {rows} "
                            f"{'sentences' if layout == 'sentence' else 'tokens'}")
    counts: dict[str, int] = {}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for j in range(group.num_columns):
            column = group.column(j)
            top = column.path_in_schema.split(".", 1)[0]
            counts[top] = counts.get(top, 0) + column.num_values
    want = {name: tokens * width for name, width in layer_dims.items()}
    if layout == "sentence":
        want["tokens"] = tokens
    for name, n in want.items():
        if name in counts and not n <= counts[name] <= n + sentences:
            raise DamagedOutput(f"{where}: column {name} holds {counts[name]} values, the manifest's {tokens} tokens "
                                f"make {n}")


def check_parquet_pages(pf, f, where: str, columns, sentences: int, tokens: int, layer_dims: Mapping[str, int],
                        max_record_bytes: int | None) -> None:
    """Raise DamagedOutput unless the pages of the leaves read for `columns` decompress to no more than the
    manifest's counts allow, by their own headers, before a page is read (formats.parquet_pages.check_page_sizes)."""
    from elmo_pipeline.formats.parquet_pages import PagesExceed, check_page_sizes
    try:
        check_page_sizes(pf, f, columns, sentences, tokens, layer_dims, max_record_bytes)
    except PagesExceed as e:
        raise DamagedOutput(f"{where}: {e}") from None
    except (ValueError, EOFError) as e:
        raise DamagedOutput(f"{where}: not a readable Parquet shard ({e})") from None


def list_lengths(column) -> np.ndarray:
    """Each row's list length of a list column (pyarrow Array or ChunkedArray); -1 for a null row."""
    import pyarrow.compute as pc
    return pc.list_value_length(column).fill_null(-1).to_numpy(zero_copy_only=False)


def check_row_lengths(rows, where: str, names, first_row: int = 0) -> np.ndarray:
    """Each row's token count of `rows` (a sentence-layout RecordBatch or Table, rows numbered from first_row),
    DamagedOutput unless each row of each layer column in `names` holds as many vectors as its `tokens`: list
    offsets shifted between rows keep the footer's totals but move sentence boundaries."""
    tokens = list_lengths(rows.column("tokens"))
    for name in names:
        vectors = list_lengths(rows.column(name))
        bad = np.flatnonzero(vectors != tokens)
        if len(bad):
            r = int(bad[0])
            raise DamagedOutput(f"{where}: row {first_row + r} holds {int(vectors[r])} vectors in column {name} for "
                                f"its {int(tokens[r])} tokens")
    return tokens


def shard_entry(where: str, entry, formats) -> dict:
    """A manifest's shard entry, checked: a dict with int sentences and tokens, each format's file name a
    relative path inside the output (inside_path)."""
    if not isinstance(entry, dict) or not all(type(entry.get(k)) is int and entry[k] >= 0     # true is no count
                                              for k in ("sentences", "tokens")):
        raise DamagedOutput(f"{where}: not a shard entry with sentence and token counts")
    return {**entry, **{f: inside_path(f"{where} {f}", entry[f]) for f in formats if f in entry}}


def checked_shards(where: str, shards: list[dict], formats, counts) -> list[dict]:
    """shards (shard_entry each), DamagedOutput when two name one file of a format (its sentences would be read twice,
    another shard's not at all) or when their sentences or tokens add up to other than the manifest's `counts`
    (sentences_written, tokens_written: their sums, as the pipeline writes them) where it holds them."""
    for fmt in formats:
        names = [s[fmt] for s in shards if fmt in s]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise DamagedOutput(f"{where}: {twice!r} is named by {names.count(twice)} shard entries")
    for key, total in (("sentences_written", "sentences"), ("tokens_written", "tokens")):
        want = counts.get(key) if isinstance(counts, dict) else None
        if type(want) is int and want != sum(s[total] for s in shards):
            raise DamagedOutput(f"{where}: its shards hold {sum(s[total] for s in shards)} {total}, its counts say "
                                f"{key} {want}")
    return shards


def check_arrow_batch(batch: pa.RecordBatch, where: str, tokens: int, sentences: int, dtype: str,
                      layer_dims: Mapping[str, int], full: bool = False) -> None:
    """Raise DamagedOutput unless the Arrow shard's batch is what its manifest entry says: `tokens` rows,
    `sentences` ids in a valid string dictionary, per-token codes sorted and in range (each sentence has
    rows), doc ids valid, each layer in `layer_dims` a fixed_size_list of `dtype` that wide; buffers large
    enough for their lengths (full: pyarrow's full validation of every column too)."""
    def fail(what: str):
        raise DamagedOutput(f"{where}: {what}")
    names = field_names(batch.schema, where)
    for col in ("id", "doc_id", "sentence_index", "token", *layer_dims):
        if col not in names:
            fail(f"no column {col!r}")
    if batch.num_rows != tokens:
        fail(f"{batch.num_rows} rows, the manifest says {tokens} tokens")
    want = pa.float16() if dtype == "float16" else pa.float32()
    for name, width in layer_dims.items():
        t = batch.schema.field(name).type
        if not pa.types.is_fixed_size_list(t) or t.value_type != want or t.list_size != width:
            fail(f"column {name} is {t}, the manifest says fixed_size_list<{want}>[{width}]")
    try:
        batch.validate()
        for name in ("id", "doc_id"):
            col = batch.column(name)
            if not (pa.types.is_dictionary(col.type) and pa.types.is_string(col.type.value_type)
                    and pa.types.is_integer(col.type.index_type)):
                fail(f"column {name} is {col.type}, not a dictionary of strings")
            col.dictionary.validate(full=True)
        batch.column("token").validate(full=True)
        if full:
            batch.validate(full=True)
    except pa.ArrowException as e:
        fail(f"invalid Arrow data ({e})")
    ids = batch.column("id")
    if len(ids.dictionary) != sentences:
        fail(f"{len(ids.dictionary)} sentence ids, the manifest says {sentences} sentences")
    codes = ids.indices.to_numpy(zero_copy_only=False)
    if (len(codes) == 0) != (sentences == 0) or len(codes) and (codes[0] != 0 or codes[-1] != sentences - 1
                                                                or _not_steps(codes)):
        fail("sentence id codes are not 0, 0, ..., 1, ... up to the last sentence (out of range or unsorted)")
    docs = batch.column("doc_id")
    dcodes = docs.indices.to_numpy(zero_copy_only=False)
    if len(dcodes) and (int(dcodes.min()) < 0 or int(dcodes.max()) >= len(docs.dictionary)):
        fail("doc id codes out of range")


def field_names(schema: pa.Schema, where: str) -> list[str]:
    """The top-level field names of an Arrow schema read from `where`; DamagedOutput when one is not UTF-8 text."""
    try:
        return schema.names
    except UnicodeDecodeError:
        raise DamagedOutput(f"{where}: a field name is not UTF-8 text") from None


def _not_steps(codes: np.ndarray) -> bool:
    """True unless consecutive codes differ by 0 or 1 (sorted, no sentence without rows)."""
    d = np.diff(codes)
    return bool(np.any((d != 0) & (d != 1)))


def check_hdf5_shape(where: str, key: str, shape: tuple, dtype, n_layers: int, dim: int, want_dtype: str,
                     tokens_left: int) -> int:
    """The rows (T) of HDF5 dataset `key` after checking its declared shape and dtype against the manifest
    ((n_layers, T, dim), or (T, dim) for one layer; T at most the shard's tokens not yet seen)."""
    ok = (len(shape) == 3 and shape[0] == n_layers) or (len(shape) == 2 and n_layers == 1)
    if not ok or shape[-1] != dim:
        want = f"({n_layers}, T, {dim})" if n_layers > 1 else f"(T, {dim})"
        raise DamagedOutput(f"{where}: dataset {key!r} has shape {shape}, the manifest says {want}")
    if np.dtype(dtype) != np.dtype(want_dtype):
        raise DamagedOutput(f"{where}: dataset {key!r} is {np.dtype(dtype)}, the manifest says {want_dtype}")
    if shape[-2] > tokens_left:
        raise DamagedOutput(f"{where}: dataset {key!r} declares {shape[-2]} rows, more than the manifest's tokens")
    return int(shape[-2])


def checked_files(where: str, manifest: dict) -> dict[str, dict] | None:
    """A manifest's `files` ({name: {"bytes", "sha256"}}, output/sink.file_record) checked whole; None when the
    manifest has none and is of a version that recorded none (read as before, not verified: recorded_files)."""
    try:
        files = recorded_files(manifest)
    except ValueError as e:
        raise DamagedOutput(f"{where}: {e}") from None
    if files is None:
        return None
    for name, rec in files.items():
        inside_path(where, name)
        if not is_file_record(rec):
            raise DamagedOutput(f"{where}: the record of {name!r} is not {{bytes, sha256}}: {_shown(rec)}")
    return files


# Files whose SHA-256 this process has checked, by what identifies their content here (_identity): a file replaced,
# rewritten or touched since is checked again; fork()ed workers (a DataLoader's) inherit it.
_VERIFIED: dict[tuple, tuple] = {}


def check_file(fs, path: str, record: dict | None, digest: bool = False, once: bool = False) -> None:
    """DamagedOutput unless `path` is a regular file (local paths: a link, a FIFO, a device or a folder is never
    opened, no hang) of the recorded size, and with `digest` of the recorded SHA-256, read in 8 MiB blocks, at
    most its size + 1 bytes (a file grown since, or linked to /dev/zero, is refused without reading it all).
    `once` (the readers): not read again where this process has checked it and it is unchanged since (_identity).
    record None (a file the manifest does not record): a local path checked to be a regular file only."""
    local = is_local_fs(fs)
    st = _regular_stat(path, record) if local else None
    if record is None:
        return
    check_size(path, fs.size(path) if st is None else st.st_size, record)
    if not digest:
        return
    key, ident = (local, path), _identity(fs, path, st)
    if once and ident is not None and _VERIFIED.get(key) == (ident, record["sha256"]):
        return
    if not same_digest(fs, path, record):
        raise DamagedOutput(f"{path}: not the file the manifest records (its SHA-256 differs)")
    if ident is not None:
        _VERIFIED[key] = (ident, record["sha256"])


def _identity(fs, path: str, st: os.stat_result | None) -> tuple | None:
    """What identifies a file's content without reading it: a local file's device, inode, size, modification and
    change times (ns: a write changes ctime, which no one can set back as utime sets mtime); a stored object's size
    and ETag (or modification time) where its store gives one; else None."""
    if st is not None:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
    try:
        info = fs.info(path) if hasattr(fs, "info") else {}
    except OSError:
        return None
    tag = next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "last_modified", "Last-Modified",
                                  "last-modified", "created")
                if info.get(k) is not None), None)
    return None if tag is None else (info.get("size"), str(tag))


def check_folders(root: str, rel: str) -> None:
    """DamagedOutput when a folder between a local output's root and its file `rel` is a link (a reader follows
    none out of the output; the pipeline writes none)."""
    folder = root
    for part in rel.split("/")[:-1]:
        folder = os.path.join(folder, part)
        if os.path.islink(folder):
            raise DamagedOutput(f"{folder}: a link, not a folder of the output")


def check_size(where: str, size: int, record: dict | None) -> None:
    """DamagedOutput unless `size` (of the file at `where`) is the one `record` holds (None: nothing to check)."""
    if record is not None and size != record["bytes"]:
        raise DamagedOutput(f"{where}: {size} bytes, the manifest records {record['bytes']}")


def _regular_stat(path: str, record: dict | None) -> os.stat_result:
    """The os.lstat of the local file `path`, DamagedOutput unless a regular file (a link is not: nothing opened)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        if record is None:
            raise                                   # as a reader opening it would (FileNotFoundError)
        raise DamagedOutput(f"{path}: cannot be read ({e.strerror}), the manifest records {record['bytes']} "
                            "bytes") from None
    return regular(st, path)


def regular(st: os.stat_result, where: str) -> os.stat_result:
    """st (an os.stat or os.lstat of `where`), DamagedOutput unless of a regular file (a FIFO's open would block, a
    device's read may never end; a link, lstat's, may lead out of the output)."""
    if stat.S_ISLNK(st.st_mode):
        raise DamagedOutput(f"{where}: not a regular file (a link)")
    if not stat.S_ISREG(st.st_mode):
        raise DamagedOutput(f"{where}: not a regular file")
    return st

