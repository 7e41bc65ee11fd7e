"""--reuse: sentences whose key (model.resolve.ModelSpec.sentence_key) an earlier output holds get that output's
stored vectors instead of being embedded. No Beam import; the graph joins the run's sentences with the earlier
outputs' key indexes by key on the runner (pipeline/graph.py, docs/reuse.md). The sources are opened and checked
while planning (pipeline/reuse_sources.py: ReuseSource, what their shards are, where).

The join is by key bucket (join_buckets: a bucket per GROUP_ROWS source sentences, by the key's first bytes): the
runner groups each bucket's Items with packed runs of the sources' (key, location) rows (ENTRY: 24 bytes a source
sentence), an element per key-index file and bucket, not one per row.
index_blobs: one key-index file -> (bucket, packed entries) per bucket.
match: a bucket's (join key, Item)s and packed entries -> (location or NOT_FOUND, Item) per Item.
read_vectors: a source shard's rows -> their tokens and stored vectors; reused_batch: those as an EmbeddedBatch.
"""
from __future__ import annotations

import binascii
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elmo_pipeline.fsio import NotTheRecordedFile, read_recorded, redact, url_fs
from elmo_pipeline.transforms.dedupe import with_copies
from elmo_pipeline.transforms.records import EmbeddedBatch, Item

KEY_HEX = 32            # a sentence key after its key prefix: the tokens' hash (model.resolve.sentence_key)
ROW_BITS = SHARD_BITS = 24   # a location packs (source, shard, row) into one int: 2^24 shards and rows at most
NOT_FOUND = -1
GROUP_ROWS = 1 << 20    # source sentences per join bucket at most, on average (24 MiB of packed entries)
MIN_BUCKETS = 64        # so that the join spreads over workers however small the sources
ENTRY = np.dtype([("key", "V16"), ("loc", "<i8")])     # a source sentence in the join: join key, location


class ReuseError(ValueError):
    """An earlier output that cannot be reused: missing, damaged, foreign or in a form not read back."""


class ForeignSourceError(ReuseError):
    """An earlier output of another model, vector settings, layers or dtype: none of its vectors are this run's."""


class KernelPathError(ForeignSourceError):
    """An earlier output computed on another kernel path (model/kernels.py): this model's vectors in other bits."""


@dataclass(frozen=True)
class ReuseSource:
    """A finished earlier output to reuse vectors from: its URL (as given: read from), label (redacted: what is
    recorded and printed), the format read back, and per shard (key-index path, data path, sentences)."""
    url: str
    label: str
    format: str
    shards: tuple[tuple[str, str, int], ...]
    records: tuple[tuple[dict | None, dict | None], ...] = ()    # per shard, (key index, data) as its manifest records
    kernel_path: str = "not compared"     # its kernel path against this run's (pipeline/reuse_sources.py)
    tokens: tuple[int, ...] = ()          # per shard, its tokens as its manifest records (bounds what is decoded)


def join_key(key: str) -> bytes:
    """The 16 bytes the join groups by: the tokens' hash of a sentence key (its key prefix is the run's, checked
    once per source: pipeline/reuse_sources.open_source)."""
    return bytes.fromhex(key[-KEY_HEX:])


def join_buckets(source_rows: int) -> int:
    """The join's key buckets for sources of `source_rows` sentences in all: a bucket's group (what a worker holds
    at once) is about GROUP_ROWS source rows at most, and a key-index file's rows travel in few, large elements."""
    return max(MIN_BUCKETS, -(-source_rows // GROUP_ROWS))


def bucket_of(key: bytes, buckets: int) -> int:
    """A join key's bucket: its first 4 bytes (uniform: a hash), modulo."""
    return int.from_bytes(key[:4], "big") % buckets


def location(source: int, shard: int, row: int) -> int:
    return (source << (SHARD_BITS + ROW_BITS)) | (shard << ROW_BITS) | row


def unpack(loc: int) -> tuple[int, int, int]:
    """(source, shard, row) of a location."""
    return loc >> (SHARD_BITS + ROW_BITS), (loc >> ROW_BITS) & ((1 << SHARD_BITS) - 1), loc & ((1 << ROW_BITS) - 1)


def by_shard(loc: int, item: Item) -> tuple[tuple[int, int], tuple[int, Item]]:
    """A found Item keyed by its (source, shard), with its row: what the found sentences are grouped by, so each
    source shard is read once."""
    source, shard, row = unpack(loc)
    return (source, shard), (row, item)


def read_source_file(path: str, record: dict | None, storage_options: dict | None) -> bytes:
    """A source file's bytes, checked against its manifest's record (fsio.read_recorded): ReuseError if it is not
    that file (swapped in, rewritten by another run since, grown, not a regular file) or is gone."""
    fs, p = url_fs(path, storage_options)
    try:
        return read_recorded(fs, p, record)
    except NotTheRecordedFile as e:
        raise ReuseError(f"--reuse: {redact(str(e))}: its vectors are not reused") from None
    except FileNotFoundError as e:         # gone since the run was planned: the source's, as while planning
        raise ReuseError(f"--reuse: {redact(path)}: gone since the run was planned ({e.strerror})") from e


KEY_WIDTH = 16 + KEY_HEX    # a key index's key: its 16-character prefix, then the hash


def index_blobs(source: int, shard: int, path: str, buckets: int, storage_options: dict | None = None,
                record: dict | None = None, rows: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(bucket, its rows of one key-index file packed as ENTRY records) for every bucket that file has rows in;
    read as Arrow buffers, no Python object per row, from the bytes checked against `record` (its manifest's),
    its key column decoded only when its pages hold at most `rows` (the manifest's sentences) keys' bytes
    (_check_key_pages). ReuseError when a key is not a key (a damaged file) or the file is not the one recorded."""
    damaged = ReuseError(f"reuse source: its key index {redact(path)} holds values that are no sentence keys")
    col = key_column(path, record, rows, storage_options, damaged)
    n = len(col)
    if n == 0:
        return
    offsets = np.frombuffer(col.buffers()[1], np.int32, n + 1, col.offset * 4)
    width = offsets[1] - offsets[0]
    if col.null_count or width != KEY_WIDTH or (np.diff(offsets) != width).any():
        raise damaged
    text = np.frombuffer(col.buffers()[2], np.uint8, n * width, offsets[0]).reshape(n, width)[:, width - KEY_HEX:]
    try:
        raw = np.frombuffer(binascii.unhexlify(text.tobytes()), np.uint8).reshape(n, KEY_HEX // 2)
    except binascii.Error:
        raise damaged from None
    entries = np.empty(n, ENTRY)
    entries["key"] = raw.view("V16").reshape(n)
    entries["loc"] = location(source, shard, 0) + np.arange(n, dtype=np.int64)
    of = np.ascontiguousarray(raw[:, :4]).view(">u4").reshape(n).astype(np.int64) % buckets     # bucket_of
    order = np.argsort(of, kind="stable")
    entries, of = entries[order], of[order]
    cuts = np.flatnonzero(np.diff(of)) + 1
    for part, b in zip(np.split(entries, cuts), of[np.concatenate([[0], cuts])]):
        yield int(b), part.tobytes()


def key_column(path: str, record: dict | None, rows: int | None, storage_options: dict | None,
               damaged: ReuseError) -> pa.Array:
    """The `key` column of a source's key-index file, read from the bytes checked against `record` and decoded only
    when its pages hold at most `rows` keys (_check_key_pages): `damaged` otherwise."""
    data = read_source_file(path, record, storage_options)
    _check_key_pages(data, rows, damaged)
    return pq.read_table(pa.BufferReader(data), columns=["key"]).column("key").combine_chunks()


def _check_key_pages(data: bytes, rows: int | None, damaged: ReuseError) -> None:
    """Raise `damaged` unless the key index in `data` holds `rows` rows (when known) in its footer and its key
    column's pages, by their own headers (formats/parquet_pages.py), hold no more values than that and decode
    to no more than their values' keys (4 length bytes and KEY_WIDTH a value, 1 KiB a page of levels and
    headers): so reading it allocates no more than its rows' keys, whatever a crafted file's compression hides."""
    import io

    from elmo_pipeline.formats.parquet_pages import chunk_span, column_pages, open_checked
    f = io.BytesIO(data)
    try:
        pf = open_checked(f)
        md = pf.metadata
        leaves = [i for i in range(md.num_columns) if pf.schema.column(i).path == "key"]
        if len(leaves) != 1 or rows is not None and md.num_rows != rows:
            raise damaged
        values = 0
        for g in range(md.num_row_groups):
            for p in column_pages(f, *chunk_span(md.row_group(g).column(leaves[0]))):
                values += p.count
                if p.uncompressed > max(p.count, 1) * (4 + KEY_WIDTH) + 1024 or values > 2 * md.num_rows + 1:
                    raise damaged
    except (ValueError, EOFError, OSError, pa.ArrowException):
        raise damaged from None


def match(items: Iterable[tuple[bytes, Item]], blobs: Iterable[bytes]) -> list[tuple[int, Item]]:
    """The join's result for one bucket: each Item (with its join key) with the smallest location of its key in the
    packed entries (deterministic whichever sources hold it), or NOT_FOUND: to be embedded."""
    items = list(items)
    if not items:
        return []
    wanted = {k for k, _ in items}
    first = np.frombuffer(b"".join(wanted), "<u8")[::2]      # each wanted key's first 8 bytes
    best: dict[bytes, int] = {}
    for blob in blobs:
        rows = np.frombuffer(blob, "<u8").reshape(-1, ENTRY.itemsize // 8)     # key (2 words), location
        for r in np.flatnonzero(np.isin(rows[:, 0], first)):                   # candidates; then the whole key
            k, loc = rows[r, :2].tobytes(), int(rows[r, 2])
            if k in wanted and loc < best.get(k, 1 << 62):
                best[k] = loc
    return [(best.get(k, NOT_FOUND), i) for k, i in items]


def read_vectors(source: ReuseSource, shard: int, rows: list[int], columns: list[tuple[str, int]],
                 storage_options: dict | None = None) -> tuple[list[list[str]], list[np.ndarray], np.ndarray]:
    """Rows `rows` of a source's shard: their tokens, per layer column the stored vectors (T, D_k) of those rows
    in order (the stored dtype, bit for bit), and their token counts (len(rows),). The file is the recorded one
    (read_source_file) and decodes to no more than its manifest's counts make: a Parquet shard's footer
    (formats.parquet_pages.open_checked) and page headers (check_page_sizes) are checked before a page is read, an
    Arrow shard's batches must be uncompressed (formats.arrow.check_uncompressed). ReuseError naming the shard
    otherwise."""
    from elmo_pipeline.formats.arrow import check_uncompressed
    from elmo_pipeline.formats.parquet_pages import check_page_sizes, open_checked
    _, path, sentences = source.shards[shard]
    names = [n for n, _ in columns]
    data = pa.py_buffer(read_source_file(path, source.records[shard][1] if source.records else None,
                                         storage_options))
    try:
        if source.format == "parquet":
            f = pa.BufferReader(data)
            pf = open_checked(f)
            if pf.metadata.num_rows != sentences:
                raise ValueError(f"{pf.metadata.num_rows} rows, its manifest says {sentences} sentences")
            if source.tokens:
                check_page_sizes(pf, f, ["tokens", *names], sentences, source.tokens[shard], dict(columns), None)
            t = pf.read(columns=["tokens", *names]).take(pa.array(rows, pa.int64()))
            tokens = t.column("tokens").to_pylist()
            lengths = np.array([len(x) for x in tokens], dtype=np.int64)
            cols = [t.column(n).combine_chunks().flatten() for n in names]
        else:           # token rows; the id dictionary holds the sentences in shard order (formats/arrow.py)
            check_uncompressed(data)
            t = pa.ipc.open_file(pa.BufferReader(data)).read_all().combine_chunks()
            sentence_of = t.column("id").chunk(0).indices.to_numpy()
            starts = np.searchsorted(sentence_of, np.arange(len(t.column("id").chunk(0).dictionary) + 1))
            take = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows] or [np.zeros(0, np.int64)])
            lengths = np.array([starts[r + 1] - starts[r] for r in rows], dtype=np.int64)
            sel = t.take(pa.array(take, pa.int64()))
            flat = sel.column("token").to_pylist()
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            tokens = [flat[bounds[k]: bounds[k + 1]] for k in range(len(rows))]
            cols = [sel.column(n).combine_chunks() for n in names]
    except (ValueError, EOFError, OSError, KeyError, IndexError, pa.ArrowException) as e:
        raise ReuseError(f"--reuse {source.label}: its shard {redact(path)} cannot be read back "
                         f"({type(e).__name__}: {redact(str(e))[:300]}): its vectors are not reused") from None
    vectors = [c.flatten().to_numpy(zero_copy_only=False).reshape(-1, d) for c, (_, d) in zip(cols, columns)]
    return tokens, vectors, lengths


def model_vectors(stored: list[np.ndarray], selection, duplicate_layer0: bool, n_layers: int, dim: int
                  ) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """Stored layer columns (T, D_k) back in the embedder's form that output.staging.ShardSpec.sources takes:
    (vectors float32 (K, T, dim = 2P), layers) with layers None (all L+1, or 'average': K = 1) or the ascending
    layers held; one copy. Exact: a float16 value widened to float32 narrows back to itself; layer 0 stored once
    (x, P wide) is [x, x]."""
    if selection == "average":
        return stored[0].astype(np.float32)[None], None
    by_layer = {k: c for k, c in zip(selection, stored)}
    layers = sorted(by_layer)
    out = np.empty((len(layers), len(stored[0]), dim), np.float32)
    for j, k in enumerate(layers):
        if k == 0 and not duplicate_layer0:
            out[j, :, : dim // 2] = out[j, :, dim // 2:] = by_layer[k]
        else:
            out[j] = by_layer[k]
    return out, None if layers == list(range(n_layers)) else tuple(layers)


def reused_batches(found: list[tuple[int, Item]], tokens: list[list[str]], stored: list[np.ndarray],
                   lengths: np.ndarray, spec, label: str, batch: int = 2000) -> Iterator[EmbeddedBatch]:
    """EmbeddedBatches of at most `batch` found sentences ((row, Item) in the order their vectors were read:
    read_vectors), each Item's copies (--dedupe) written with its vectors, all counted as reused from the source
    `label` (its redacted URL; spec: the run's output.staging.ShardSpec). ReuseError naming it when a row holds
    other tokens than its key says: a damaged key index, never wrong vectors."""
    for (row, item), toks in zip(found, tokens):
        if tuple(toks) != item.tokens:
            raise ReuseError(f"--reuse {label}: row {row} of a shard holds other tokens than its key index says "
                             "(a damaged output)")
    ends = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for a in range(0, len(found), batch):
        b = min(a + batch, len(found))
        part = [c[ends[a]: ends[b]] for c in stored]
        vectors, layers = model_vectors(part, spec.selection, spec.duplicate_layer0, spec.n_layers, spec.dim)
        out = with_copies(EmbeddedBatch([i for _, i in found[a:b]], vectors, ends[a: b + 1] - ends[a], layers))
        yield dataclasses.replace(out, copies=0, source=label)
