"""Reading the pipeline's output back: sentences with their layers, ids and tokens. No Beam import.

An output folder is opened through its manifest.json, so only complete, committed shards are read
(never files of retried bundles under _staging/). Local paths and fsspec URLs (s3://, gs://, ...) work;
`storage_options` are the fsspec options of the folder's filesystem (e.g. {"endpoint_url": ...} for s3).

    from downstream import ElmoOutput, ElmoDataset, ElmoIterableDataset, collate, to_arrow_table

    out = ElmoOutput("out/corpus")                    # manifest, shards, layer names, widths
    for s in out.sentences():                         # dicts: id, doc_id, sentence_index, tokens, layers
        s["layers"]                                   # float32 (L, T, 2P), layer 0 duplicated: = ElmoEmbedder output
    ds = ElmoDataset("out/corpus", labels={"doc-1": 1})                 # map-style (torch Dataset)
    it = ElmoIterableDataset("out/corpus", shuffle=True, seed=0)        # streams, shuffles across shards
    loader = DataLoader(it, batch_size=32, collate_fn=collate, num_workers=2)
    table = to_arrow_table("out/corpus", columns=["id", "tokens", "layer_2"])   # pyarrow.Table

A record's `layers` always stacks the selected layers as (L, T, 2P) float32: layer 0, which the Parquet
output stores P wide by default (the token vector once), is duplicated to [x, x] as AllenNLP does, so a
record equals what `model.ElmoEmbedder.embed_sentence` returns for the same tokens (layer selection
`--layers all`). Outputs written with `--layers average` or `top` give L = 1.
"""
from __future__ import annotations

import json
import posixpath
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from formats.hdf5 import hdf5_unkey
from formats.layout import FORMATS, read_manifest
from formats.parquet import META_COLUMNS
from fsio import is_local_fs, keyed, url_fs

_LINE_ID = re.compile(r":(\d+)$")


class ElmoOutput:
    """One pipeline output folder, read through its manifest.json.

    path: the folder (path or URL); storage_options: fsspec options for its filesystem.
    Attributes: manifest, shards (manifest entries), layer_names (['layer_0', 'layer_1', ...] or
    ['average']), layer_dims ({name: stored width}), dim (2P, the width of a record's layers),
    formats, parquet_layout. Formats: parquet, hdf5, arrow (--format arrow; downstream/mapped.py reads it
    without loading it).
    """

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None):
        self.path = path.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = url_fs(self.path, keyed(self.path, self.storage_options))
        manifest = read_manifest(self.fs, self.root)
        if manifest is None:
            raise FileNotFoundError(f"{self.path}: no manifest.json (not a finished pipeline output)")
        self.manifest = manifest
        self.shards: list[dict] = list(self.manifest.get("shards", []))
        self.layer_names: list[str] = list(self.manifest["layers"])
        self.layer_dims: dict[str, int] = {k: int(v) for k, v in self.manifest["layer_dims"].items()}
        self.dim = max(self.layer_dims.values())
        self.formats: list[str] = list(self.manifest.get("formats", []))
        self.parquet_layout: str = self.manifest.get("parquet_layout", "sentence")

    def __repr__(self) -> str:
        return (f"ElmoOutput({self.path!r}: {len(self.shards)} shards, {self.num_sentences} sentences, "
                f"layers {self.layer_names}, dim {self.dim}, formats {self.formats})")

    @property
    def num_sentences(self) -> int:
        return sum(int(s["sentences"]) for s in self.shards)

    def shard_path(self, i: int, fmt: str) -> str:
        """Filesystem path (for self.fs) of shard i in format fmt."""
        if fmt not in self.shards[i]:
            raise ValueError(f"{self.path}: shard {i} has no {fmt} file (formats: {self.formats})")
        return posixpath.join(self.root, self.shards[i][fmt])

    def default_format(self) -> str:
        return next((f for f in ("parquet", "hdf5") if f in self.formats), "arrow")

    def _check(self, fmt: str | None, layers: Sequence[str] | None) -> tuple[str, list[str]]:
        fmt = fmt or self.default_format()
        if fmt not in FORMATS or fmt not in self.formats:
            raise ValueError(f"{self.path}: format {fmt!r} not written (formats: {self.formats})")
        names = list(layers) if layers else list(self.layer_names)
        missing = [n for n in names if n not in self.layer_names]
        if missing:
            raise ValueError(f"{self.path}: no layer(s) {missing} (has {self.layer_names})")
        return fmt, names

    def iter_shard(self, i: int, fmt: str | None = None, layers: Sequence[str] | None = None,
                   stacked: bool = True) -> Iterator[dict]:
        """Records of shard i in stored order (sorted by id): dicts with id, doc_id, sentence_index,
        tokens (None for an HDF5-only output) and layers (float32 (L, T, dim)).

        stacked=False: `stored` (the per-layer (T, D_k) arrays as stored: dtype kept, layer 0 maybe P
        wide) instead of `layers`; stack(record["stored"]) makes `layers`."""
        fmt, names = self._check(fmt, layers)
        if fmt == "parquet":
            it = self._iter_parquet_tokens(i, names) if self.parquet_layout == "token" else self._iter_parquet(i, names)
        elif fmt == "arrow":
            it = self._iter_arrow(i, names)
        else:
            it = self._iter_hdf5(i, names)
        for r in it:
            if stacked:
                r["layers"] = self.stack(r.pop("stored"))
            yield r

    def sentences(self, fmt: str | None = None, layers: Sequence[str] | None = None) -> Iterator[dict]:
        """All records, shard after shard (manifest order), each shard sorted by id."""
        for i in range(len(self.shards)):
            yield from self.iter_shard(i, fmt, layers)

    # -- Parquet, a row per sentence
    def _iter_parquet(self, i: int, names: list[str]) -> Iterator[dict]:
        import pyarrow.parquet as pq
        with self.fs.open(self.shard_path(i, "parquet"), "rb") as f:
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches(batch_size=1024, columns=[*META_COLUMNS, *names]):
                yield from self._batch_records(batch, names)

    def _batch_records(self, batch, names: list[str]) -> Iterator[dict]:
        ids = batch.column("id").to_pylist()
        doc_ids = batch.column("doc_id").to_pylist()
        indices = batch.column("sentence_index").to_pylist()
        tokens = batch.column("tokens").to_pylist()
        mats, starts = [], None
        for name in names:
            col = batch.column(name)
            if starts is None:
                lens = col.value_lengths().to_numpy(zero_copy_only=False)
                starts = np.concatenate([[0], np.cumsum(lens)])
            vecs = col.flatten()                       # fixed_size_list<float, D>, one per token
            d = vecs.type.list_size
            mats.append(vecs.flatten().to_numpy(zero_copy_only=False).reshape(-1, d))
        for r in range(len(ids)):
            s, e = int(starts[r]), int(starts[r + 1])
            yield {"id": ids[r], "doc_id": doc_ids[r], "sentence_index": indices[r], "tokens": tokens[r],
                   "stored": [m[s:e] for m in mats]}

    # -- Parquet, a row per token (rows sorted by sentence id, then token index)
    def _iter_parquet_tokens(self, i: int, names: list[str]) -> Iterator[dict]:
        import pyarrow.parquet as pq
        with self.fs.open(self.shard_path(i, "parquet"), "rb") as f:
            t = pq.read_table(f, columns=["id", "doc_id", "sentence_index", "token_index", "token", *names])
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

    # -- Arrow IPC, a row per token (formats/arrow.py): memory-mapped when local, else read whole
    def _iter_arrow(self, i: int, names: list[str]) -> Iterator[dict]:
        import pyarrow as pa
        from downstream.mapped import flat_vectors, open_arrow_shard, sentence_index
        path = self.shard_path(i, "arrow")
        if is_local_fs(self.fs):
            batch = open_arrow_shard(path)
        else:
            reader = pa.ipc.open_file(pa.BufferReader(self.fs.cat_file(path)))
            batch = reader.get_batch(0) if reader.num_record_batches else pa.RecordBatch.from_pylist([], schema=reader.schema)
        ids, offsets, doc_ids, indices = sentence_index(batch)
        mats = [flat_vectors(batch, n) for n in names]
        tokens = batch.column("token")
        for s, (sid, did) in enumerate(zip(ids.to_pylist(), doc_ids.to_pylist())):
            a, e = int(offsets[s]), int(offsets[s + 1])
            yield {"id": sid, "doc_id": did, "sentence_index": int(indices[s]),
                   "tokens": tokens.slice(a, e - a).to_pylist(), "stored": [m[a:e] for m in mats]}

    # -- HDF5 (AllenNLP layout): (layers, T, 2P) or (T, 2P); tokens from the Parquet twin when there is one
    def _iter_hdf5(self, i: int, names: list[str]) -> Iterator[dict]:
        import h5py
        meta: dict[str, tuple] = {}
        if "parquet" in self.shards[i] and self.parquet_layout == "sentence":
            import pyarrow.parquet as pq
            with self.fs.open(self.shard_path(i, "parquet"), "rb") as f:
                t = pq.read_table(f, columns=list(META_COLUMNS))
            for sid, did, k, toks in zip(*(t.column(c).to_pylist() for c in META_COLUMNS)):
                meta[sid] = (did, k, toks)
        pick = [self.layer_names.index(n) for n in names]
        with self.fs.open(self.shard_path(i, "hdf5"), "rb") as f, h5py.File(f, "r") as h:
            for key in sorted(h.keys(), key=hdf5_unkey):
                sid = hdf5_unkey(key)
                arr = h[key][...]
                if arr.ndim == 2:
                    arr = arr[None]
                did, k, toks = meta.get(sid) or (sid.rsplit("#", 1)[0], _sentence_index(sid), None)
                yield {"id": sid, "doc_id": did, "sentence_index": k, "tokens": toks,
                       "stored": [arr[j] for j in pick]}

    def stack(self, arrays: list[np.ndarray]) -> np.ndarray:
        """(L, T, dim) float32 from per-layer (T, D_k); a P-wide layer 0 becomes [x, x]."""
        out = np.empty((len(arrays), arrays[0].shape[0] if arrays else 0, self.dim), dtype=np.float32)
        for k, a in enumerate(arrays):
            if a.shape[1] == self.dim:
                out[k] = a
            elif 2 * a.shape[1] == self.dim:
                out[k, :, : a.shape[1]] = a
                out[k, :, a.shape[1]:] = a
            else:
                raise ValueError(f"layer width {a.shape[1]} is neither {self.dim} nor half of it")
        return out


def _sentence_index(sentence_id: str) -> int:
    tail = sentence_id.rsplit("#", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def lookup_label(labels: Mapping[str, Any], record: dict) -> Any:
    """A record's label: by sentence id, else document id, else the input line number (ids of
    text inputs end with ':<line>'), else None."""
    for key in (record["id"], record["doc_id"]):
        if key in labels:
            return labels[key]
    m = _LINE_ID.search(record["doc_id"] or "")
    if m and m.group(1) in labels and record.get("sentence_index", 0) == 0:
        return labels[m.group(1)]
    return None


def _attach(record: dict, labels: Mapping[str, Any] | None, key: str) -> dict | None:
    """Add labels[...] as record[key]; None when labels are given and this record has none."""
    if labels is None:
        return record
    value = lookup_label(labels, record)
    if value is None:
        return None
    record[key] = value
    return record


def _open(source: "str | ElmoOutput", storage_options) -> ElmoOutput:
    return source if isinstance(source, ElmoOutput) else ElmoOutput(source, storage_options)


try:  # torch is a dependency of the package; keep the module importable for pure-arrow use anyway
    from torch.utils.data import Dataset as _TorchDataset
    from torch.utils.data import IterableDataset as _TorchIterable
except ImportError:  # pragma: no cover
    _TorchDataset = _TorchIterable = object  # type: ignore[assignment,misc]


class ElmoDataset(_TorchDataset):
    """Map-style dataset over one or more output folders, held in memory as stored (float16 stays float16,
    layer 0 P wide); record i is built on access. Records are in manifest order (shard by shard).

    labels: {sentence id | document id | line number: label}; records without a label are dropped
    (their count is `unlabelled`). label_key: the record key the label goes to ("label", or "tags"
    for token labels). transform: applied to each record on access.
    """

    def __init__(self, sources: "str | ElmoOutput | Sequence[str | ElmoOutput]", fmt: str | None = None,
                 layers: Sequence[str] | None = None, labels: Mapping[str, Any] | None = None,
                 label_key: str = "label", storage_options: Mapping[str, Any] | None = None, transform=None):
        if isinstance(sources, (str, ElmoOutput)):
            sources = [sources]
        self.outputs = [_open(s, storage_options) for s in sources]
        self.records: list[dict] = []
        self._source: list[int] = []
        self.unlabelled = 0
        self.transform = transform
        for k, out in enumerate(self.outputs):
            for i in range(len(out.shards)):
                for r in out.iter_shard(i, fmt, layers, stacked=False):
                    r = _attach(r, labels, label_key)
                    if r is None:
                        self.unlabelled += 1
                        continue
                    self.records.append(r)
                    self._source.append(k)
        self.dim = self.outputs[0].dim if self.outputs else 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        r = dict(self.records[i])
        r["layers"] = self.outputs[self._source[i]].stack(r.pop("stored"))
        return self.transform(r) if self.transform else r


class ElmoIterableDataset(_TorchIterable):
    """Streams records of one or more output folders without loading them all.

    shuffle: shard order is permuted (seed + epoch) and records pass through a shuffle buffer of
    `buffer_size` (seeded by seed, epoch and worker). Under a DataLoader with workers, each worker reads
    a disjoint share of the shards (worker w takes shards w, w + n, ...), so every record comes once
    per epoch; with fewer shards than workers some workers get none. Call set_epoch(e) before each
    epoch for a new order (without it every iteration repeats the same order).
    """

    def __init__(self, sources: "str | ElmoOutput | Sequence[str | ElmoOutput]", fmt: str | None = None,
                 layers: Sequence[str] | None = None, labels: Mapping[str, Any] | None = None,
                 label_key: str = "label", shuffle: bool = True, seed: int = 0, buffer_size: int = 1000,
                 storage_options: Mapping[str, Any] | None = None, transform=None):
        if isinstance(sources, (str, ElmoOutput)):
            sources = [sources]
        self.outputs = [_open(s, storage_options) for s in sources]
        self.fmt, self.layers, self.labels, self.label_key = fmt, layers, labels, label_key
        self.shuffle, self.seed, self.buffer_size = shuffle, seed, max(1, buffer_size)
        self.transform = transform
        self.epoch = 0
        self.units = [(o, i) for o in self.outputs for i in range(len(o.shards))]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_sentences(self) -> int:
        """Sentences listed in the manifests (labelled or not; no __len__, as labels may drop some)."""
        return sum(o.num_sentences for o in self.outputs)

    def __iter__(self) -> Iterator[dict]:
        import torch.utils.data
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        units = list(self.units)
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}:shards").shuffle(units)
        units = units[worker::n_workers]
        records = self._records(units)
        if self.shuffle:
            records = _buffer_shuffle(records, self.buffer_size, random.Random(f"{self.seed}:{self.epoch}:{worker}"))
        for r in records:
            yield self.transform(r) if self.transform else r

    def _records(self, units) -> Iterator[dict]:
        for out, i in units:
            for r in out.iter_shard(i, self.fmt, self.layers):
                r = _attach(r, self.labels, self.label_key)
                if r is not None:
                    yield r


def _buffer_shuffle(items: Iterator[dict], size: int, rng: random.Random) -> Iterator[dict]:
    """Approximate shuffle in bounded memory: keep `size` items, emit a random one as each new arrives."""
    buf: list[dict] = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        j = rng.randrange(size)
        buf[j], x = x, buf[j]
        yield x
    rng.shuffle(buf)
    yield from buf


def collate(records: Sequence[dict]) -> dict:
    """Pad a list of records into a batch.

    layers (B, L, T, D) float32, zero past each length; mask (B, T) bool; lengths (B,) int64;
    ids, doc_ids, tokens (lists). With labels: label (B,) int64 when the records have an int
    "label"; tags (B, T) int64 padded with -100 when they have int lists "tags" (CrossEntropy's
    ignore_index). Labels of other types stay as lists.
    """
    import torch
    lengths = [int(r["layers"].shape[1]) for r in records]
    B, T = len(records), max(lengths, default=0)
    L, D = (records[0]["layers"].shape[0], records[0]["layers"].shape[2]) if records else (0, 0)
    layers = torch.zeros(B, L, T, D, dtype=torch.float32)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(records):
        n = lengths[b]
        layers[b, :, :n] = torch.from_numpy(np.asarray(r["layers"], dtype=np.float32))
        mask[b, :n] = True
    batch = {"layers": layers, "mask": mask, "lengths": torch.tensor(lengths, dtype=torch.int64),
             "ids": [r["id"] for r in records], "doc_ids": [r.get("doc_id") for r in records],
             "tokens": [r.get("tokens") for r in records]}
    if records and "label" in records[0]:
        vals = [r["label"] for r in records]
        batch["label"] = torch.tensor(vals, dtype=torch.int64) if all(isinstance(v, int) for v in vals) else vals
    if records and "tags" in records[0]:
        tags = torch.full((B, T), -100, dtype=torch.int64)
        for b, r in enumerate(records):
            tags[b, : len(r["tags"])] = torch.tensor(r["tags"], dtype=torch.int64)
        batch["tags"] = tags
    return batch


def to_arrow_table(source: "str | ElmoOutput", columns: Sequence[str] | None = None, fmt: str | None = None,
                   storage_options: Mapping[str, Any] | None = None):
    """The output as one pyarrow.Table (the manifest's shards, in order), for analysis.

    Parquet: the stored columns as written (layer 0 P wide unless --duplicate-layer0), `columns`
    selects. HDF5-only outputs: id, doc_id, sentence_index, tokens (null without a Parquet twin) and
    one list<fixed_size_list<float32, 2P>> column per layer (layer 0 duplicated, as stored in HDF5).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = _open(source, storage_options)
    fmt = fmt or out.default_format()
    if fmt == "parquet":
        tables = []
        for i in range(len(out.shards)):
            with out.fs.open(out.shard_path(i, "parquet"), "rb") as f:
                tables.append(pq.read_table(f, columns=list(columns) if columns else None))
        if not tables:
            raise ValueError(f"{out.path}: no shards")
        return pa.concat_tables(tables)
    recs = list(out.sentences("hdf5"))
    data = {"id": pa.array([r["id"] for r in recs], pa.string()),
            "doc_id": pa.array([r["doc_id"] for r in recs], pa.string()),
            "sentence_index": pa.array([r["sentence_index"] for r in recs], pa.int32()),
            "tokens": pa.array([r["tokens"] for r in recs], pa.list_(pa.string()))}
    lengths = np.array([r["layers"].shape[1] for r in recs], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    for k, name in enumerate(out.layer_names):
        flat = np.concatenate([r["layers"][k].reshape(-1) for r in recs]) if recs else np.zeros(0, np.float32)
        data[name] = pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(pa.array(flat), out.dim))
    table = pa.table(data)
    return table.select(list(columns)) if columns else table


def to_hf_dataset(source: "str | ElmoOutput", columns: Sequence[str] | None = None, fmt: str | None = None,
                  storage_options: Mapping[str, Any] | None = None):
    """The output as a Hugging Face `datasets.Dataset` (in memory, over to_arrow_table's table; no
    download, no cache files). Layer columns become nested sequences of float; use
    `.with_format("torch")` or `"numpy"` for tensors."""
    import datasets
    return datasets.Dataset(to_arrow_table(source, columns, fmt, storage_options))
