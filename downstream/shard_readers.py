"""The records of one shard, by format: Parquet (a row per sentence or per token), Arrow IPC, HDF5. No Beam import.

Each reader takes the shard's filesystem and path and yields dicts in stored order (sorted by id): id,
doc_id, sentence_index, tokens and `stored`, the per-layer (T, D_k) arrays as stored (dtype kept, layer 0
maybe P wide); ElmoOutput.stack makes them one (L, T, 2P) float32 array.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from elmo_pipeline.downstream.arrow_shards import flat_vectors, read_arrow_shard, sentence_index
from elmo_pipeline.downstream.shard_checks import DamagedOutput, check_hdf5_shape, check_row_lengths
from elmo_pipeline.formats.hdf5 import hdf5_unkey
from elmo_pipeline.formats.parquet import META_COLUMNS, TOKEN_META_COLUMNS
from elmo_pipeline.formats.parquet_pages import open_checked


@contextmanager
def unreadable(path: str, kind: str, errors: tuple):
    """What the format's library raises on a damaged shard (`errors`) as one DamagedOutput naming the file."""
    try:
        yield
    except DamagedOutput:
        raise
    except errors as e:
        raise DamagedOutput(f"{path}: not a readable {kind} shard ({' '.join(str(e).split())})") from None


PARQUET_ERRORS = (pa.ArrowException, OSError, ValueError)
HDF5_ERRORS = (OSError, RuntimeError, KeyError, ValueError)


def parquet_records(fs, path: str, names: list[str], check) -> Iterator[dict]:
    """Records of a Parquet shard with a row per sentence, read 1024 rows at a time; check(pf, f, columns), given
    the opened pyarrow ParquetFile before a page is read, raises unless its schema, footer and the page headers of
    the columns read match its manifest."""
    with fs.open(path, "rb") as f, unreadable(path, "Parquet", PARQUET_ERRORS):
        pf = open_checked(f)
        check(pf, f, [*META_COLUMNS, *names])
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[*META_COLUMNS, *names]):
            yield from _batch_records(batch, names, path, row)
            row += batch.num_rows


def _batch_records(batch, names: list[str], path: str, first_row: int) -> Iterator[dict]:
    """The records of a batch of rows (the first numbered first_row), each layer's list as long as its tokens."""
    ids = batch.column("id").to_pylist()
    doc_ids = batch.column("doc_id").to_pylist()
    indices = batch.column("sentence_index").to_pylist()
    tokens = batch.column("tokens").to_pylist()
    lens = check_row_lengths(batch, path, names, first_row)
    starts = np.concatenate([[0], np.cumsum(np.maximum(lens, 0))])
    mats = []
    for name in names:
        col = batch.column(name)
        vecs = col.flatten()                       # fixed_size_list<float, D>, one per token
        d = vecs.type.list_size
        mats.append(vecs.flatten().to_numpy(zero_copy_only=False).reshape(-1, d))
    for r in range(len(ids)):
        s, e = int(starts[r]), int(starts[r + 1])
        yield {"id": ids[r], "doc_id": doc_ids[r], "sentence_index": indices[r], "tokens": tokens[r],
               "stored": [m[s:e] for m in mats]}


def parquet_token_records(fs, path: str, names: list[str], check) -> Iterator[dict]:
    """Records of a Parquet shard with a row per token (rows sorted by sentence id, then token index); check as
    parquet_records."""
    with fs.open(path, "rb") as f, unreadable(path, "Parquet", PARQUET_ERRORS):
        pf = open_checked(f)
        check(pf, f, [*TOKEN_META_COLUMNS, *names])
        t = pf.read(columns=[*TOKEN_META_COLUMNS, *names])
    ids = t.column("id").to_pylist()
    mats = [t.column(n).combine_chunks().flatten().to_numpy(zero_copy_only=False)
            .reshape(t.num_rows, -1) for n in names]
    tidx = t.column("token_index").to_pylist()
    order = np.array(sorted(range(t.num_rows), key=lambda r: (ids[r], tidx[r])), dtype=np.int64)
    toks, docs, sidx = t.column("token").to_pylist(), t.column("doc_id").to_pylist(), t.column("sentence_index").to_pylist()
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and ids[order[end]] == ids[order[start]]:
            end += 1
        rows = order[start:end]
        first = rows[0]
        yield {"id": ids[first], "doc_id": docs[first], "sentence_index": sidx[first],
               "tokens": [toks[r] for r in rows], "stored": [m[rows] for m in mats]}
        start = end


def parquet_meta(fs, path: str, check) -> dict[str, tuple]:
    """{sentence id: (doc_id, sentence_index, tokens)} of a Parquet shard with a row per sentence; check as
    parquet_records."""
    with fs.open(path, "rb") as f, unreadable(path, "Parquet", PARQUET_ERRORS):
        pf = open_checked(f)
        check(pf, f, META_COLUMNS)
        t = pf.read(columns=list(META_COLUMNS))
    return {sid: (did, k, toks) for sid, did, k, toks in zip(*(t.column(c).to_pylist() for c in META_COLUMNS))}


def arrow_records(fs, path: str, names: list[str], check) -> Iterator[dict]:
    """Records of an Arrow IPC shard (a row per token): memory-mapped when local, else read whole; check(batch)
    raises unless the shard matches its manifest entry."""
    batch = read_arrow_shard(fs, path)
    check(batch)
    ids, offsets, doc_ids, indices = sentence_index(batch)
    mats = [flat_vectors(batch, n) for n in names]
    tokens = batch.column("token")
    for s, (sid, did) in enumerate(zip(ids.to_pylist(), doc_ids.to_pylist())):
        a, e = int(offsets[s]), int(offsets[s + 1])
        yield {"id": sid, "doc_id": did, "sentence_index": int(indices[s]),
               "tokens": tokens.slice(a, e - a).to_pylist(), "stored": [m[a:e] for m in mats]}


def hdf5_records(fs, path: str, pick: list[int], meta: dict[str, tuple] | None, expect: dict) -> Iterator[dict]:
    """Records of an HDF5 shard (AllenNLP layout: (layers, T, 2P) or (T, 2P) per sentence), layers `pick`
    (indices); doc ids, sentence indices and tokens from `meta` (parquet_meta of the Parquet twin: each dataset
    must name one of its sentences, its T their tokens' count), else (None: no twin) from the id and None. expect
    (ElmoOutput.hdf5_expect): each dataset's declared shape and dtype is checked before it is read, so no read
    allocates more than the manifest's tokens (nor a chunk larger than its dataset: a read inflates whole chunks;
    nor a filter's output: a dataset with filters, which the writer never uses, is refused unread; nor more bytes
    than the dataset stores, all of them within the file);
    a dataset is read only when it is the file's own (no link, no external or virtual storage). A shard HDF5
    cannot read (damaged metadata: its signature, groups, names, datatypes) is refused with DamagedOutput naming
    it."""
    import h5py
    with fs.open(path, "rb") as f, unreadable(path, "HDF5", HDF5_ERRORS), h5py.File(f, "r") as h:
        keys = list(h.keys())
        if not all(isinstance(k, str) for k in keys):
            raise DamagedOutput(f"{path}: a dataset name is not UTF-8 text")
        keys.sort(key=hdf5_unkey)
        if len(keys) != expect["sentences"]:
            raise DamagedOutput(f"{path}: {len(keys)} datasets, the manifest says {expect['sentences']} sentences")
        left, stored, size = expect["tokens"], 0, fs.size(path)
        for key in keys:
            sid = hdf5_unkey(key)
            if not isinstance(h.get(key, getlink=True), h5py.HardLink):     # a link may name another file
                raise DamagedOutput(f"{path}: {key!r} is a link, not a dataset of the file")
            d = h.get(key)
            if not isinstance(d, h5py.Dataset):
                raise DamagedOutput(f"{path}: {key!r} is not a dataset")
            if d.external or d.is_virtual:      # its bytes elsewhere (a FIFO would block, another file is not ours)
                raise DamagedOutput(f"{path}: {key!r} keeps its data outside the file")
            left -= check_hdf5_shape(path, key, d.shape, d.dtype, expect["n_layers"], expect["dim"],
                                     expect["dtype"], left)
            if d.chunks and any(c > max(n, 1) for c, n in zip(d.chunks, d.shape)):    # a read inflates whole chunks
                raise DamagedOutput(f"{path}: {key!r} is stored in chunks {d.chunks}, larger than its shape {d.shape}")
            if d.id.get_create_plist().get_nfilters():      # deflate may inflate a chunk past its shape, unbounded
                raise DamagedOutput(f"{path}: {key!r} is stored through filters (compression), the writer uses none")
            stored += d.id.get_storage_size()
            if d.id.get_storage_size() < d.nbytes or stored > size:    # unwritten storage reads as fill values
                raise DamagedOutput(f"{path}: {key!r} stores {d.id.get_storage_size()} of the {d.nbytes} bytes its "
                                    f"shape declares" + ("" if stored <= size else f", beyond the file's {size}"))
            if meta is not None and sid not in meta:
                raise DamagedOutput(f"{path}: dataset {key!r} names a sentence its Parquet twin does not hold")
            did, k, toks = (meta or {}).get(sid) or (sid.rsplit("#", 1)[0], _sentence_index(sid), None)
            if toks is not None and d.shape[-2] != len(toks):
                raise DamagedOutput(f"{path}: dataset {key!r} holds {d.shape[-2]} vectors for the {len(toks)} tokens "
                                    "of its Parquet twin")
            arr = d[...]
            if arr.ndim == 2:
                arr = arr[None]
            yield {"id": sid, "doc_id": did, "sentence_index": k, "tokens": toks,
                   "stored": [arr[j] for j in pick]}


def _sentence_index(sentence_id: str) -> int:
    tail = sentence_id.rsplit("#", 1)[-1]
    return int(tail) if tail.isdigit() else 0
