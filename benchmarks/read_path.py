"""The read path as a training loop consumes it: every delivered tensor reduced inside the timed loop, each form
against a `cat` of the same files in the same run.

    python -m benchmarks.read_path [--lines N] [--pairs 5] [--big-tokens 2000000] [--out benchmarks/results/read_path_KIND.json]

All of WikiText-2 valid (or its first --lines lines) is written by the pipeline with a near-free biLM as wide as the
original (benchmarks/host_cost.WIDE_CHEAP), default sharding, --format parquet,arrow, one stored dtype at a time
(fp16, then fp32; each deleted before the next), its pages then put in one state, as a training job finds an output
written earlier: written back, dropped from the page cache, read back by a dataset's own reads (its index, one stream
epoch; read_back). Each row is the median of --pairs pairs, a pair being one `cat` of the Arrow files then one epoch
of the form on a newly opened dataset (opening it, the index, is timed apart: set-up seconds), the forms taken in turn
pair by pair (a slow spell of the machine falls on all alike); a form's rate is stored vector bytes delivered per
second, its line ending "NN.N % of page-cache bandwidth" (the cat's bytes/s). Rows that deliver an fp16 output as
float32 also give "% of floor": the floor is the cat's time for the vector bytes plus torch's fp16 -> float32
conversion of the same bytes (measured in the same run, one stream batch at a time into a reused buffer; on a GPU that
conversion belongs on the device: deliver the stored dtype and call .float() there). Random-access rows read every
byte of each sentence and give "% of its bound": the cat's bytes/s divided by the mean bytes of the sentences read;
they time the reads only (opening the dataset, drawing the positions and, by id, listing the ids and building the id
table are timed apart: set-up seconds), in turn too. Rows marked "second epoch" time a form's second epoch on the same
dataset (the first is part of their set-up). Every form runs with its defaults: a batch of 1 MiB or more read by the
caller and the dataset's helper thread (threads=2), stream batches of 8 MiB, padded ones of at most 6 MiB once padded,
in their dtype. References, no form: the bucketed batches' rows alone, copied from a newly opened dataset's maps in
the sampler's order into a reused buffer (one thread, then two threads a half each: what copying in that order costs,
faults included); the padded batches' values per stored value; batch() of 32 random's padded float32 tensors alone,
each zeroed and summed in a kept buffer with nothing read (the least its padding costs: every value written once and
read once by the consumer), and from it the most that form can reach with its sentences read at the cat's speed;
ds[p]'s positions read as views of a newly opened dataset, nothing copied (what the first reads of those
sentences from newly mapped pages, their page faults, leave a record);
a `cat` of a copy of the files written by `cp` (how a file was written changes how fast `cat` reads it back);
opening a dataset with the files' pages dropped: its seconds and the bytes it read into the page cache (mincore);
last, `cat` after the files' pages were dropped and read back first by one `cat`, then first by building the index
(how pages came into the page cache changes it too). The index's memory: a fresh process over the same output
(default sharding) and over a --big-tokens output of synthetic sentences sharded like it, RSS (anonymous and file
pages) after the index, after 100k random reads and after 100k id lookups.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import RESULTS, SHARED, machine


def _files(out: str, fmt: str = "arrow") -> list[str]:
    return sorted(glob.glob(os.path.join(out, fmt, "*")))


def _size(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def cat_seconds(files: list[str]) -> float:
    """Seconds of one `cat` of the files to /dev/null."""
    t = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def convert_seconds(ds) -> float:
    """Seconds torch takes to convert every stored fp16 vector byte of ds to float32 (a stream batch of rows at a time,
    already in memory, into a reused buffer)."""
    import torch
    rows = [torch.cat([v.reshape(-1) for v in b["vectors"]]) for b in ds.stream()]
    dst = torch.empty(max(len(r) for r in rows), dtype=torch.float32)
    t = time.perf_counter()
    for r in rows:
        dst[: len(r)].copy_(r)
    return time.perf_counter() - t


def drop_pages(files: list[str]) -> None:
    """The files' pages written back and dropped from the page cache, as the pipeline does after each shard
    (fsio.fs.release_written; the benchmark wrote them)."""
    from elmo_pipeline.fsio.fs import release_written, url_fs
    fs = url_fs(files[0])[0] if files else None
    for path in files:
        release_written(fs, path)


def read_back(out: str, files: list[str]) -> None:
    """Put the files' pages in one state before the forms, as a training job finds an output written earlier:
    dropped (drop_pages), then read back by a dataset's own reads (building its index, one stream epoch). How pages
    came into the page cache changes how fast every reader, `cat` too, reads them (first_read_cats)."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    drop_pages(files)
    for _ in MappedDataset(out, tokens=False, dtype=None).stream():
        pass


def cached_bytes(path: str) -> int:
    """Bytes of the file at path in the page cache (mincore(2) over a map of it, which reads nothing)."""
    import ctypes
    import mmap
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    vec = (ctypes.c_ubyte * -(-len(m) // mmap.PAGESIZE))()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    view = np.frombuffer(m, np.uint8)
    if mincore(view.ctypes.data, len(m), vec) != 0:
        raise OSError(ctypes.get_errno(), f"mincore of {path}")
    del view
    m.close()
    return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) * mmap.PAGESIZE


def cold_open(out: str, files: list[str]) -> dict:
    """Seconds to open a MappedDataset (its index) of an output whose pages were dropped (drop_pages), and the bytes
    of the files in the page cache after it: what opening reads."""
    import gc
    from elmo_pipeline.downstream.mapped import MappedDataset
    gc.collect()
    drop_pages(files)
    t = time.perf_counter()
    ds = MappedDataset(out, tokens=False)
    seconds = time.perf_counter() - t
    cached = sum(cached_bytes(f) for f in files)
    del ds
    return {"seconds": seconds, "cached_bytes": cached}


def first_read_cats(out: str, files: list[str], n: int) -> dict:
    """Median seconds of `cat` of the files (no map of them held) after their pages were dropped (drop_pages) and
    brought back into the page cache first by one `cat` (a sequential read), then by building a MappedDataset's
    index before one `cat` (the faults of its mapping)."""
    import gc
    from elmo_pipeline.downstream.mapped import MappedDataset
    gc.collect()
    drop_pages(files)
    cat_seconds(files)
    by_cat = float(np.median([cat_seconds(files) for _ in range(n)]))
    drop_pages(files)
    ds = MappedDataset(out, tokens=False)
    cat_seconds(files)
    del ds
    gc.collect()
    return {"first_read_by_cat_seconds": by_cat,
            "first_read_by_the_index_seconds": float(np.median([cat_seconds(files) for _ in range(n)]))}


def pairs(forms: dict, files: list[str]) -> dict:
    """{name: medians} of each form's pairs, one cat of files then the form, the forms taken in turn (round i
    runs pair i of every form that has one: a slow spell of the machine falls on all of them alike).
    forms: {name: (form, pairs)}; form() opens what it reads (timed apart: set-up seconds) and returns run;
    run() (timed) returns the stored vector bytes it delivered."""
    got: dict = {name: ([], [], [], 0) for name in forms}
    for i in range(max((n for _, n in forms.values()), default=0)):
        for name, (form, n) in forms.items():
            if i >= n:
                continue
            cats, runs, setups, _ = got[name]
            cats.append(cat_seconds(files))
            t = time.perf_counter()
            run = form()
            setups.append(time.perf_counter() - t)
            t = time.perf_counter()
            delivered = run()
            runs.append(time.perf_counter() - t)
            got[name] = (cats, runs, setups, delivered)
    size = _size(files)
    return {name: {"seconds": float(np.median(runs)), "cat_seconds": float(np.median(cats)), "bytes": delivered,
                   "cat_bytes": size, "fractions": [delivered / r / (size / c) for c, r in zip(cats, runs)],
                   "setup_seconds": float(np.median(setups)), "pairs": len(runs)}
            for name, (cats, runs, setups, delivered) in got.items()}


# -- the forms: each opens its dataset and returns run(), which reads one epoch, sums every delivered tensor and
# returns the stored vector bytes delivered
def _stored_bytes(ds, lengths) -> int:
    return int(lengths.sum()) * sum(ds.widths) * ds.stored_dtype.itemsize


def stream_form(out: str, layers=None, dtype=None, as_float32=False):
    from elmo_pipeline.downstream.mapped import MappedDataset
    ds = MappedDataset(out, tokens=False, dtype=dtype)
    names = layers or ds.layers
    width = sum(ds.outputs[0].layer_dims[n] for n in names) * ds.stored_dtype.itemsize

    def run() -> int:
        total, acc = 0, 0.0
        for b in ds.stream(layers=layers):
            for v in b["vectors"]:
                acc += float((v.float() if as_float32 else v).sum())
            total += int(b["lengths"].sum()) * width
        return total
    return run


def _padded_run(ds, batches):
    """run() of a form whose batches (an iterable made anew each epoch) hold padded layers."""
    def run() -> int:
        total, acc = 0, 0.0
        for b in batches():
            acc += float(b["layers"].sum())
            total += _stored_bytes(ds, b["lengths"])
        return total
    return run


def padded_stream_form(out: str, dtype):
    from elmo_pipeline.downstream.mapped import MappedDataset
    ds = MappedDataset(out, tokens=False, dtype=dtype)
    return _padded_run(ds, lambda: ds.stream(padded=True))


def bucket_form(out: str, dtype):
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.sampler import BucketBatchSampler
    ds = MappedDataset(out, tokens=False, dtype=dtype)
    sampler = BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0)
    return _padded_run(ds, lambda: ds.batches(sampler, reuse=True))


def packed_bucket_form(out: str, dtype):
    """Length-bucketed batches in the packed form (the sentences back to back, no padding), every vector summed."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.sampler import BucketBatchSampler
    ds = MappedDataset(out, tokens=False, dtype=dtype)
    sampler = BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0)

    def run() -> int:
        total, acc = 0, 0.0
        for b in ds.batches(sampler, reuse=True, packed=True):
            for v in b["vectors"]:
                acc += float(v.sum())
            total += _stored_bytes(ds, b["lengths"])
        return total
    return run


def padded_values(out: str, form: str) -> float:
    """Values in the padded batches of a form (B x L x T x dim, counted over one untimed pass) per stored value
    its sentences hold: what layer 0's second copy and the padding add."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.sampler import BucketBatchSampler
    ds = MappedDataset(out, tokens=False, dtype=None)
    if form == "stream":
        batches = ds.stream(padded=True)
    elif form == "bucket":
        batches = ds.batches(BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0), reuse=True)
    else:                                                        # batch() of 32 random positions
        picks = np.random.default_rng(0).integers(0, len(ds), 5_120)
        batches = (ds.batch(picks[s: s + 32].tolist()) for s in range(0, len(picks), 32))
    padded = stored = 0
    for b in batches:
        padded += b["layers"].numel()
        stored += int(b["lengths"].sum()) * sum(ds.widths)
    return padded / stored


def second_epoch(form):
    """The form's second epoch on the same dataset: its set-up opens the dataset and reads a first epoch, untimed
    (the buffers a form keeps from epoch to epoch are then in memory)."""
    def setup():
        run = form()
        run()
        return run
    return setup


def loader_form(out: str, workers: int):
    """The documented DataLoader recipe (docs/downstream.md), float32 batches of 32 in length buckets, each built in
    the dataset's reused buffers (reuse=True; worker processes build batches of their own)."""
    from torch.utils.data import DataLoader
    from elmo_pipeline.downstream.mapped import MappedDataset, unbatched
    from elmo_pipeline.downstream.sampler import BucketBatchSampler
    ds = MappedDataset(out, tokens=False, reuse=True)
    loader = DataLoader(ds, batch_sampler=BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0),
                        collate_fn=unbatched, num_workers=workers)
    return _padded_run(ds, lambda: loader)


def bucket_copies(out: str, threads: int):
    """The form (see pairs) of the bucketed batches' rows copied alone: set-up opens the dataset (newly mapped
    shards, as the forms find them) and lists each sentence's rows of each layer in the sampler's order; run()
    copies them by numpy into a reused 4 MiB buffer, `threads` threads a contiguous share each (what copying from
    the maps in that order costs, building nothing). Returns the stored vector bytes."""
    from concurrent.futures import ThreadPoolExecutor
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.sampler import BucketBatchSampler
    ds = MappedDataset(out, tokens=False, dtype=None)
    views = [v for batch in BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0)
             for p in batch for v in ds.views(p)]
    step = -(-len(views) // threads)

    def copy(share: list) -> None:
        buf = np.empty(4 << 20, np.uint8)
        for v in share:
            flat = v.reshape(-1).view(np.uint8)
            buf[: len(flat)] = flat

    def run() -> int:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(copy, [views[i: i + step] for i in range(0, len(views), step)]))
        return _stored_bytes(ds, ds.lengths)
    return run


def random_form(out: str, n: int, kind: str):
    """The form (see pairs) of n random reads, every byte of each summed: kind views (by position), id (views by
    id), record (ds[p], float32), batch (ds.batch of 32 random positions, float32), packed (ds.batch(packed=True)
    of 32 random positions, stored dtype: the sentences back to back, no padding), fill (batch's padded float32
    tensors, each zeroed and summed in one of three kept buffers, nothing read: the least its padded values cost, a
    write and the consumer's read of each). Its set-up opens the dataset, draws the positions and, for id, lists
    the ids and builds the id table by a first lookup; run() does the reads and returns the stored bytes of the
    sentences read."""
    def form():
        import torch
        from elmo_pipeline.downstream.batching import tensor
        from elmo_pipeline.downstream.mapped import MappedDataset
        ds = MappedDataset(out, tokens=False, dtype=None if kind == "packed" else "float32")
        picks = np.random.default_rng(0).integers(0, len(ds), n)
        ids = [ds.index.meta(int(p))["id"] for p in picks] if kind == "id" else None
        if ids:
            ds.position(ids[0])                                  # the id table, built once
        nbytes = _stored_bytes(ds, ds.lengths[picks])

        def run() -> int:
            acc = 0.0
            if kind in ("views", "id"):
                for j, p in enumerate(picks.tolist()):
                    for v in ds.views(ds.position(ids[j]) if ids else p):
                        acc += float(tensor(v).sum())
            elif kind == "record":
                for p in picks.tolist():
                    acc += float(torch.from_numpy(ds[p]["layers"]).sum())
            elif kind == "packed":
                for s in range(0, n, 32):
                    for v in ds.batch(picks[s: s + 32].tolist(), packed=True)["vectors"]:
                        acc += float(v.sum())
            elif kind == "fill":
                for j, shape in enumerate(shapes):
                    t = kept[j % len(kept)][: math.prod(shape)].view(shape)
                    acc += float(t.zero_().sum())
            else:
                for s in range(0, n, 32):
                    acc += float(ds.batch(picks[s: s + 32].tolist())["layers"].sum())
            return nbytes
        if kind == "fill":                                       # batch()'s shapes; kept buffers as its Batcher's
            shapes = [(len(g), len(ds.widths), int(ds.lengths[g].max()), ds.dim)
                      for g in (picks[s: s + 32] for s in range(0, n, 32))]
            kept = [torch.zeros(max(math.prod(s) for s in shapes)) for _ in range(3)]
        return run
    return form


FILL = "reference: batch() of 32 random's padded tensors, zeroed and summed alone"
RECORD, RECORD_VIEWS = "ds[p], float32 record", "reference: ds[p]'s positions as views, newly mapped"


def dtype_rows(out: str, dtype: str, n_pairs: int) -> dict:
    """Every row of one output, printed as they come."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.mapped import MappedDataset
    o = ElmoOutput(out)
    files = _files(out)
    top = [o.layer_names[-1]]
    d = {"tokens": o.manifest["counts"]["tokens_written"], "sentences": o.num_sentences, "shards": len(o.shards),
         "file_bytes": _size(files), "rows": {}, "random_access": {}}
    read_back(out, files)
    ds = MappedDataset(out, tokens=False, dtype=None)
    vector_bytes = _stored_bytes(ds, ds.lengths)
    d["vector_bytes"] = vector_bytes
    conv = convert_seconds(ds) if dtype == "float16" else 0.0
    d["fp16_to_float32_seconds"] = conv
    print(f"\n## {dtype}: {d['tokens']} tokens, {d['sentences']} sentences, {d['shards']} shards; "
          f"arrow files {d['file_bytes'] / 1e9:.2f} GB", flush=True)
    cat_seconds(files)                                           # warm
    f32 = dtype == "float16"
    rows = {
        "stream, all layers, stored dtype": (lambda: stream_form(out), False),
        "stream, top layer, stored dtype": (lambda: stream_form(out, top), False),
        "stream, all layers, as float32 (v.float())": (lambda: stream_form(out, as_float32=True), f32),
        "stream(padded=True), stored dtype": (lambda: padded_stream_form(out, None), False),
        "stream(padded=True), float32": (lambda: padded_stream_form(out, "float32"), f32),
        "batches, BucketBatchSampler(32, shuffle), reuse, stored dtype": (lambda: bucket_form(out, None), False),
        "batches, BucketBatchSampler(32, shuffle), reuse, float32": (lambda: bucket_form(out, "float32"), f32),
        "batches, BucketBatchSampler(32, shuffle), reuse, packed, stored dtype":
            (lambda: packed_bucket_form(out, None), False),
        "batches, BucketBatchSampler(32, shuffle), reuse, packed, float32":
            (lambda: packed_bucket_form(out, "float32"), f32),
        "batches, BucketBatchSampler(32, shuffle), reuse, stored dtype, second epoch":
            (second_epoch(lambda: bucket_form(out, None)), False),
        "DataLoader recipe (num_workers=0), float32": (lambda: loader_form(out, 0), f32),
        "DataLoader recipe (num_workers=0), float32, second epoch": (second_epoch(lambda: loader_form(out, 0)), f32),
        "DataLoader, num_workers=2, float32": (lambda: loader_form(out, 2), f32),
        "reference: the bucketed batches' rows copied alone, one thread": (lambda: bucket_copies(out, 1), False),
        "reference: the bucketed batches' rows copied alone, two threads": (lambda: bucket_copies(out, 2), False),
    }
    d["rows"] = pairs({name: (fn, n_pairs if "workers=2" not in name else max(1, min(3, n_pairs)))
                       for name, (fn, _) in rows.items()}, files)
    for name, (_, to_float32) in rows.items():
        r = d["rows"][name]
        rate, cat = r["bytes"] / r["seconds"], r["cat_bytes"] / r["cat_seconds"]
        r["fraction"] = rate / cat
        line = (f"{name}: {rate / 1e9:.2f} GB/s; cat {cat / 1e9:.2f} GB/s; {100 * r['fraction']:.1f} % of page-cache "
                f"bandwidth; set-up {r['setup_seconds']:.3f} s apart")
        if to_float32:
            floor_s = r["cat_seconds"] * vector_bytes / r["cat_bytes"] + conv
            r["floor_seconds"], r["fraction_of_floor"] = floor_s, floor_s / r["seconds"] * r["bytes"] / vector_bytes
            line += f"; {100 * r['fraction_of_floor']:.1f} % of floor (cat + torch fp16 -> float32)"
        print(line, flush=True)
    d["padded_values_per_stored_value"] = pv = {k: padded_values(out, k) for k in ("stream", "bucket", "random")}
    print(f"padded batches hold {pv['stream']:.2f}x the stored values (stream(padded=True)), {pv['bucket']:.2f}x "
          f"(bucketed batches of 32), {pv['random']:.2f}x (batch() of 32 random sentences)", flush=True)
    copy = os.path.join(out, "copy")
    shutil.copytree(os.path.join(out, "arrow"), copy)
    copies = sorted(glob.glob(os.path.join(copy, "*")))
    cat_seconds(copies)
    d["cat_of_a_copy"] = c = {"seconds": float(np.median([cat_seconds(copies) for _ in range(n_pairs)])),
                              "pipeline_written_seconds": float(np.median([cat_seconds(files) for _ in range(n_pairs)]))}
    print(f"reference: cat of the arrow files {d['file_bytes'] / c['pipeline_written_seconds'] / 1e9:.2f} GB/s; of a "
          f"copy of them written by cp {d['file_bytes'] / c['seconds'] / 1e9:.2f} GB/s", flush=True)
    shutil.rmtree(copy)
    kinds = {"by position, views": ("views", 20_000), "by id, views": ("id", 20_000), RECORD: ("record", 5_000),
             RECORD + ", second epoch": ("record", 5_000), RECORD_VIEWS: ("views", 5_000),
             "batch() of 32 random, float32": ("batch", 5_120),
             "batch(packed=True) of 32 random, stored dtype": ("packed", 5_120), FILL: ("fill", 5_120)}
    got = pairs({label: ((second_epoch if "second epoch" in label else lambda f: f)(random_form(out, n, kind)), n_pairs)
                 for label, (kind, n) in kinds.items()}, files)
    for label, (kind, n) in kinds.items():
        g = got[label]
        sec, cat = g["seconds"], g["cat_bytes"] / g["cat_seconds"]
        bound = cat / (g["bytes"] / n)
        r = d["random_access"][label] = {"sentences_per_s": n / sec, "bytes": g["bytes"], "sentences": n,
                                         "bound_sentences_per_s": bound, "fraction_of_bound": n / sec / bound,
                                         "fraction": g["bytes"] / sec / cat, "setup_seconds": g["setup_seconds"],
                                         "fractions_of_bound": g["fractions"], "pairs": g["pairs"]}
        line = (f"random access, {label}: {r['sentences_per_s'] / 1e3:.1f}k sentences/s; bound "
                f"{bound / 1e3:.1f}k; {100 * r['fraction_of_bound']:.1f} % of its bound; "
                f"{100 * r['fraction']:.1f} % of page-cache bandwidth; set-up {r['setup_seconds']:.3f} s apart")
        if f32 and kind in ("record", "batch"):                 # fp16 delivered as float32: its floor too
            floor_s = g["cat_seconds"] * g["bytes"] / g["cat_bytes"] + conv * g["bytes"] / vector_bytes
            r["floor_seconds"], r["fraction_of_floor"] = floor_s, floor_s / sec
            line += f"; {100 * r['fraction_of_floor']:.1f} % of floor (cat + torch fp16 -> float32)"
        print(line, flush=True)
    record, views = d["random_access"][RECORD], d["random_access"][RECORD_VIEWS]
    record["fraction_of_first_reads"] = f = record["sentences_per_s"] / views["sentences_per_s"]
    print(f"ds[p], float32 record: {100 * f:.1f} % of the rate of its positions' views, nothing copied (its "
          f"sentences' first reads from newly mapped pages: {100 * views['fraction_of_bound']:.1f} % of the bound)",
          flush=True)
    padded, fill = d["random_access"]["batch() of 32 random, float32"], d["random_access"][FILL]
    t_fill = fill["sentences"] / fill["sentences_per_s"]
    t_bound = padded["sentences"] / padded["bound_sentences_per_s"]
    padded["ceiling_fraction_of_bound"] = c = t_bound / (t_bound + t_fill)
    line = (f"batch() of 32 random, float32: its padded values alone take {t_fill / t_bound:.2f}x the bound's time; "
            f"with the sentences read at cat's speed it reaches at most {100 * c:.1f} % of its bound")
    print(line, flush=True)
    del ds
    d["cold_open"] = c = cold_open(out, files)
    print(f"opening the dataset with the files' pages dropped: {c['seconds']:.3f} s; {c['cached_bytes'] / 1e6:.1f} MB of "
          f"the {d['file_bytes'] / 1e9:.2f} GB read into the page cache", flush=True)
    d["cat_after_first_read"] = c = first_read_cats(out, files, n_pairs)
    print(f"reference: cat of the arrow files, their pages dropped and read back first by cat "
          f"{d['file_bytes'] / c['first_read_by_cat_seconds'] / 1e9:.2f} GB/s; first by building the index "
          f"{d['file_bytes'] / c['first_read_by_the_index_seconds'] / 1e9:.2f} GB/s", flush=True)
    return d


INDEX_RSS = r"""
import json, sys, numpy as np, pyarrow as pa, torch
from elmo_pipeline.downstream.mapped import MappedDataset
pa.DictionaryArray.from_arrays(pa.array([0], pa.int32()), pa.array(["a"])).indices.to_numpy()  # one-time: ~28 MB
def rss():
    f = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("VmRSS", "RssAnon", "RssFile")))
    return {k: int(v.split()[0]) * 1024 for k, v in f.items()}
r0 = rss()
ds = MappedDataset(sys.argv[1], tokens=False)
r1 = rss()
picks = np.random.default_rng(1).integers(0, len(ds), 100_000)   # 0.8 MB, counted
for p in picks:
    ds.views(int(p))
r2 = rss()
for p in picks:
    ds.views(ds.position(ds.index.meta(int(p))["id"]))
r3 = rss()
n = len(ds)
print(json.dumps({"sentences": n, "shards": len(ds.units), "index_bytes": ds.index_bytes(),
                  "after_index": {k: r1[k] - r0[k] for k in r0}, "after_100k_reads": {k: r2[k] - r0[k] for k in r0},
                  "after_100k_id_lookups": {k: r3[k] - r0[k] for k in r0},
                  "bytes_per_sentence": (r3["VmRSS"] - r0["VmRSS"]) / n,
                  "anonymous_bytes_per_sentence": (r3["RssAnon"] - r0["RssAnon"]) / n}))
"""


def index_rss(out: str) -> dict:
    """RSS growth of a fresh process holding a MappedDataset of `out` (INDEX_RSS)."""
    p = subprocess.run([sys.executable, "-c", INDEX_RSS, out], capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def big_output(tmp: str, tokens: int, per_shard: int, width: int = 64) -> str:
    """An arrow output of `tokens` tokens of synthetic 20-token sentences (one `width`-wide float16 layer: the
    index does not depend on the width), `per_shard` sentences a shard, written by formats.arrow."""
    from elmo_pipeline.formats.arrow import arrow_table, write_arrow
    from elmo_pipeline.formats.layout import ARROW_LAYOUT, MANIFEST, SCHEMA_VERSION
    from elmo_pipeline.formats.parquet import ShardColumns
    out = os.path.join(tmp, "big")
    os.makedirs(os.path.join(out, "arrow"))
    sentences = tokens // 20
    n_shards, shards = -(-sentences // per_shard), []
    rng = np.random.default_rng(0)
    for i in range(n_shards):
        k = min(per_shard, sentences - i * per_shard)
        lengths = np.full(k, 20, np.int32)
        ids = [f"doc-{i:05d}-{j:04d}#0" for j in range(k)]
        n = int(lengths.sum())
        c = ShardColumns(ids, [s[:-2] for s in ids], [0] * k, lengths, ["tok"] * n, np.zeros((n, 2), np.int32),
                         [rng.standard_normal((n, width), dtype=np.float32).astype(np.float16)])
        name = f"arrow/part-{i:05d}-of-{n_shards:05d}.arrow"
        write_arrow(arrow_table(c, [("average", width)]), os.path.join(out, name))
        shards.append({"arrow": name, "sentences": k, "tokens": n})
    manifest = {"schema_version": SCHEMA_VERSION, "layers": ["average"], "layer_dims": {"average": width},
                "formats": ["arrow"], "dtype": "float16", "arrow_layout": ARROW_LAYOUT, "shards": shards}
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return out


def build_model(tmp: str, lines: int | None) -> tuple[tuple[str, str], str]:
    """(model files, input text) under tmp: the near-free wide biLM and WikiText-2 valid (its first `lines`)."""
    from benchmarks.host_cost import WIDE_CHEAP
    from elmo_pipeline.model.synthetic import write_random_bilm
    model = write_random_bilm(WIDE_CHEAP, os.path.join(tmp, "model"))
    with open(os.path.join(SHARED, "data", "wikitext-2", "valid.txt"), encoding="utf-8", newline="\n") as f:
        text = f.readlines()
    src = os.path.join(tmp, "valid.txt")
    with open(src, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(text[:lines] if lines else text)
    return model, src


def build_output(model: tuple[str, str], src: str, out: str, dtype: str, formats: str = "parquet,arrow") -> str:
    subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", src, "--output", out,
                    "--options-file", model[0], "--weight-file", model[1], "--torch-threads", "1",
                    "--progress", "off", "--format", formats, "--dtype", dtype], check=True, capture_output=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=None, help="first lines of WikiText-2 valid.txt (default all)")
    ap.add_argument("--pairs", type=int, default=5, help="cat + form pairs per row (the median is reported)")
    ap.add_argument("--big-tokens", type=int, default=2_000_000)
    ap.add_argument("--out", default=os.path.join(RESULTS, "read_path.json"))
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    res = {"machine": machine(), "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30,
           "load_average_at_start": os.getloadavg(), "lines": args.lines or "all", "one_process": True,
           "torch_threads": 1, "pairs": args.pairs,
           "method": "each row: the median of `pairs` pairs, one cat of the arrow files then one epoch of the "
                     "form (the forms in turn, pair by pair), every delivered tensor summed in the loop, one thread "
                     "(no read-ahead), the forms' defaults; rates in stored vector bytes delivered per second; each "
                     "row times the reads, its set-up (dataset opened; for random access positions drawn, ids "
                     "listed, id table built) apart",
           "dtypes": {}}
    print(f"# read path, {res['machine']}, one process, 1 torch thread; median of {args.pairs} (cat, form) pairs; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        model, src = build_model(tmp, args.lines)
        for dtype in ("float16", "float32"):
            out = build_output(model, src, os.path.join(tmp, dtype), dtype)
            res["dtypes"][dtype] = d = dtype_rows(out, dtype, args.pairs)
            d["index"] = ix = index_rss(out)
            print(f"index of this output ({ix['sentences']} sentences, {ix['shards']} shards): "
                  f"{ix['bytes_per_sentence']:.0f} bytes of RSS a sentence after 100k reads and 100k id lookups, "
                  f"{ix['anonymous_bytes_per_sentence']:.0f} of them anonymous", flush=True)
            shutil.rmtree(out)                           # out of the page cache before the next dtype
        per_shard = max(1, round(res["dtypes"]["float16"]["sentences"] / res["dtypes"]["float16"]["shards"]))
        b = res["big_index"] = index_rss(big_output(tmp, args.big_tokens, per_shard))
        b["tokens"], b["sentences_per_shard"] = args.big_tokens, per_shard
        print(f"\n## index of a {args.big_tokens}-token output ({b['sentences']} sentences, {per_shard} a shard as the "
              f"default sharding gives): {b['index_bytes'] / b['sentences']:.0f} bytes a sentence held; RSS "
              f"{b['bytes_per_sentence']:.0f} bytes a sentence after 100k reads and 100k id lookups, "
              f"{b['anonymous_bytes_per_sentence']:.0f} of them anonymous", flush=True)
    res["load_average_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"-> {args.out}; load {res['load_average_at_end'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
