"""The read path of downstream training, every reader and layout against the page-cache bandwidth of the same run.

    python -m benchmarks.read_path [--lines 3000] [--big-tokens 10000000] [--out benchmarks/results/read_path_KIND.json]

Outputs of WikiText-2 valid (its first --lines lines) are written by the pipeline with a near-free biLM as
wide as the original (benchmarks/host_cost.WIDE_CHEAP), one dtype at a time (fp16, then fp32; each deleted
before the next so both stay in the page cache), --format parquet,arrow (hdf5 too with --slow-readers).
Each row is the best of 3 runs, each run right after a `cat` of the files the row reads (the page-cache
bandwidth: the best of those 3 cats); the files are read once before the first row (warm). A row's rate is
in stored vector bytes per second that land in torch tensors (or numpy arrays for pyarrow), its line ending
in "NN.N % of page-cache bandwidth". Cold rows: `dd` and the reader each after posix_fadvise(DONTNEED),
best of 3. Random access: views by position and by id, float32 records (best of 3 passes).
The index's memory: a --big-tokens output of synthetic vectors (one 64-wide float16 layer: the index does
not depend on the width) written by formats.arrow, RSS after the index is built, after random reads and
after id lookups (which build the id hash table).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import RESULTS, SHARED, machine


def _files(out: str, fmt: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out, fmt, "*")))


def _size(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def cat_rate(files: list[str]) -> float:
    """Bytes/s of one `cat` of the files to /dev/null (read(2) of 128 KiB into one buffer)."""
    t = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return _size(files) / (time.perf_counter() - t)


def drop_cache(files: list[str]) -> None:
    """The files' pages out of the page cache (fsync, then POSIX_FADV_DONTNEED: no privileges needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def dd_rate(files: list[str]) -> float:
    """Bytes/s of `dd bs=4M` of each file to /dev/null."""
    t = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M"], stderr=subprocess.DEVNULL, check=True)
    return _size(files) / (time.perf_counter() - t)


def paired(fn, reference, before=None, runs: int = 3) -> dict:
    """Best of `runs` of fn (returns bytes read) and of reference (bytes/s), each run of fn right after one
    of reference; before() runs ahead of each (e.g. drop_cache)."""
    best_s, n, ref = float("inf"), 0, 0.0
    for _ in range(runs):
        if before:
            before()
        ref = max(ref, reference())
        if before:
            before()
        t = time.perf_counter()
        n = fn()
        best_s = min(best_s, time.perf_counter() - t)
    return {"seconds": best_s, "bytes": n, "reference_bytes_per_s": ref, "fraction": n / best_s / ref,
            "best_of": runs}


def stream(out: str, layers, batch_tokens: int = 2048, padded: bool = False) -> int:
    """Every sentence in file order with MappedDataset.stream (the vectors land in a reused torch buffer;
    padded: also (B, L, T, dim) float32 batches); returns stored vector bytes read."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    ds = MappedDataset(out, tokens=False, dtype="float32" if padded else None)
    total = 0
    for b in ds.stream(batch_tokens=batch_tokens, layers=layers, padded=padded):
        total += sum(v.numel() * v.element_size() for v in b["vectors"])
    return total


def stream_mapped(out: str, layers, dtype) -> int:
    """Every sentence, padded batches of 32 in length buckets (every stored byte copied out of the mapped file
    into a batch tensor); returns stored vector bytes read."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.sampler import BucketBatchSampler
    ds = MappedDataset(out, layers=layers, tokens=False, dtype=dtype)
    item = ds.stored_dtype.itemsize
    width = sum(ds.widths)
    total = 0
    for b in ds.batches(BucketBatchSampler(ds.lengths, batch_size=32)):
        total += int(b["lengths"].sum()) * width * item
    return total


def stream_records(out: str, fmt: str, layers, iterable: bool) -> int:
    from elmo_pipeline.downstream import ElmoDataset, ElmoIterableDataset, collate
    ds = ElmoIterableDataset(out, fmt=fmt, layers=layers, shuffle=False) if iterable else \
        ElmoDataset(out, fmt=fmt, layers=layers)
    o = ds.outputs[0]
    width = sum(o.layer_dims[n] for n in (layers or o.layer_names))
    item = np.dtype(o.manifest["dtype"]).itemsize
    total, batch = 0, []
    for r in ds:
        batch.append(r)
        if len(batch) == 32:
            collate(batch)
            total += sum(x["layers"].shape[1] for x in batch) * width * item
            batch = []
    if batch:
        collate(batch)
        total += sum(x["layers"].shape[1] for x in batch) * width * item
    return total


def pyarrow_columns(out: str, layers) -> int:
    import pyarrow.parquet as pq
    total = 0
    for f in _files(out, "parquet"):
        t = pq.read_table(f, columns=layers)
        for c in t.columns:
            a = c.combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
            total += a.nbytes
    return total


def random_access(out: str, n: int, copy: bool, by_id: bool, passes: int = 3) -> dict:
    """Random lookups from the page cache, best of `passes`: sentences/s (views of all layers, by position or
    by id, or a float32 record by position with copy)."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    ds = MappedDataset(out, tokens=False)
    picks = np.random.default_rng(0).integers(0, len(ds), n).tolist()
    ids = [ds._meta(p)["id"] for p in picks]
    ds.position(ids[0])                                  # the id hash table (built once)
    best = 0.0
    for _ in range(passes):
        t = time.perf_counter()
        if by_id:
            for s in ids:
                ds.views(ds.position(s))
        elif copy:
            for p in picks:
                ds[p]
        else:
            for p in picks:
                ds.views(p)
        best = max(best, n / (time.perf_counter() - t))
    return {"sentences_per_s": best, "lookups": n, "best_of": passes}


def build_model(tmp: str, lines: int) -> tuple[tuple[str, str], str]:
    """(model files, input text) under tmp: the near-free wide biLM and WikiText-2 valid's first `lines` lines."""
    from benchmarks.host_cost import WIDE_CHEAP
    from elmo_pipeline.model.synthetic import write_random_bilm
    model = write_random_bilm(WIDE_CHEAP, os.path.join(tmp, "model"))
    with open(os.path.join(SHARED, "data", "wikitext-2", "valid.txt"), encoding="utf-8", newline="\n") as f:
        text = [next(f, "") for _ in range(lines)]
    src = os.path.join(tmp, "valid.txt")
    with open(src, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(text)
    return model, src


def build_output(model: tuple[str, str], src: str, out: str, dtype: str, formats: str) -> str:
    subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", src, "--output", out,
                    "--options-file", model[0], "--weight-file", model[1], "--torch-threads", "1",
                    "--progress", "off", "--format", formats, "--dtype", dtype], check=True, capture_output=True)
    return out


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def big_index(tmp: str, tokens: int, shard_tokens: int = 1_000_000) -> dict:
    """RSS of a MappedDataset over a `tokens`-token arrow output of synthetic vectors (20-token sentences)."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.formats.arrow import arrow_table, write_arrow
    from elmo_pipeline.formats.layout import ARROW_LAYOUT, MANIFEST
    from elmo_pipeline.formats.parquet import ShardColumns
    out = os.path.join(tmp, "big")
    os.makedirs(os.path.join(out, "arrow"))
    n_shards, shards = -(-tokens // shard_tokens), []
    rng = np.random.default_rng(0)
    for i in range(n_shards):
        n = min(shard_tokens, tokens - i * shard_tokens)
        lengths = np.full(n // 20, 20, np.int32)
        lengths[-1] += n - int(lengths.sum())
        ids = [f"doc-{i:04d}-{k:06d}#0" for k in range(len(lengths))]
        c = ShardColumns(ids, [s[:-2] for s in ids], [0] * len(ids), lengths, ["tok"] * n,
                         np.zeros((n, 2), np.int32), [rng.standard_normal((n, 64), dtype=np.float32).astype(np.float16)])
        name = f"arrow/part-{i:05d}-of-{n_shards:05d}.arrow"
        write_arrow(arrow_table(c, [("average", 64)]), os.path.join(out, name))
        shards.append({"arrow": name, "sentences": len(ids), "tokens": n})
    manifest = {"layers": ["average"], "layer_dims": {"average": 64}, "formats": ["arrow"], "dtype": "float16",
                "arrow_layout": ARROW_LAYOUT, "shards": shards}
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f)
    size = _size(_files(out, "arrow"))
    before = rss_kb()
    t = time.perf_counter()
    ds = MappedDataset(out, tokens=False)
    build_s = time.perf_counter() - t
    after_index, index_bytes = rss_kb(), ds.index_bytes()
    picks = np.random.default_rng(1).integers(0, len(ds), 100_000).tolist()
    t = time.perf_counter()
    for p in picks:
        ds.views(p)
    rate = len(picks) / (time.perf_counter() - t)
    after_reads = rss_kb()
    ids = [ds._meta(p)["id"] for p in picks]
    t = time.perf_counter()
    ds.position(ids[0])
    table_s = time.perf_counter() - t
    t = time.perf_counter()
    for sid in ids:
        ds.views(ds.position(sid))
    id_rate = len(ids) / (time.perf_counter() - t)
    after_ids = rss_kb()
    n = len(ds)
    return {"tokens": tokens, "sentences": n, "file_bytes": size, "index_bytes": index_bytes,
            "index_bytes_with_id_table": ds.index_bytes(), "index_build_s": build_s, "id_table_build_s": table_s,
            "rss_growth_index_mb": (after_index - before) / 1024,
            "rss_growth_after_100k_random_reads_mb": (after_reads - before) / 1024,
            "rss_growth_after_100k_id_lookups_mb": (after_ids - before) / 1024,
            "rss_bytes_per_sentence": (after_ids - before) * 1024 / n,
            "random_views_per_s": rate, "views_by_id_per_s": id_rate,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def dtype_rows(out: str, dtype: str, slow: bool) -> dict:
    """Every row of one output (module docstring), printed as they come."""
    from elmo_pipeline.downstream import ElmoDataset, ElmoOutput
    o = ElmoOutput(out)
    top = [o.layer_names[-1]]
    arrow, parquet = _files(out, "arrow"), _files(out, "parquet")
    sizes = {fmt: _size(_files(out, fmt)) for fmt in o.formats}
    d = {"tokens": o.manifest["counts"]["tokens_written"], "sentences": o.num_sentences, "file_bytes": sizes,
         "rows": {}}
    print(f"\n## {dtype}: {d['tokens']} tokens, {d['sentences']} sentences; files {sizes}")
    cold = lambda: drop_cache(arrow)     # noqa: E731
    rows = {"MappedDataset.stream, all layers, cold cache (vs cold dd)": (lambda: stream(out, None),
                                                                          lambda: dd_rate(arrow), cold)}
    for f in (arrow, parquet):
        cat_rate(f)                                      # warm
    on_arrow, on_parquet = (lambda: cat_rate(arrow)), (lambda: cat_rate(parquet))
    rows.update({
        "MappedDataset.stream, all layers, stored dtype": (lambda: stream(out, None), on_arrow, None),
        "MappedDataset.stream, top layer, stored dtype": (lambda: stream(out, top), on_arrow, None),
        "MappedDataset.stream, all layers, batch_tokens=8192": (lambda: stream(out, None, 8192), on_arrow, None),
        "MappedDataset.stream, all layers, padded float32 batches": (lambda: stream(out, None, padded=True),
                                                                      on_arrow, None),
        "MappedDataset.batches (length buckets of 32), all layers, stored dtype":
            (lambda: stream_mapped(out, None, None), on_arrow, None),
        "pyarrow read_table of the vector columns (parquet)": (lambda: pyarrow_columns(out, o.layer_names),
                                                               on_parquet, None),
        "ElmoIterableDataset (parquet) + collate": (lambda: stream_records(out, "parquet", None, True), on_parquet, None),
        "ElmoIterableDataset (arrow) + collate": (lambda: stream_records(out, "arrow", None, True), on_arrow, None),
    })
    if slow:
        hdf5 = _files(out, "hdf5")
        rows["ElmoIterableDataset (hdf5) + collate"] = (lambda: stream_records(out, "hdf5", None, True),
                                                        lambda: cat_rate(hdf5), None)
    for name, (fn, ref, before) in rows.items():
        r = d["rows"][name] = paired(fn, ref, before)
        r["vs"] = "dd_cold" if before else "cat"
        r["tokens_per_s"] = d["tokens"] / r["seconds"]
        what = "cold dd bandwidth" if before else "page-cache bandwidth"
        print(f"{name}: {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, {r['tokens_per_s'] / 1e3:.0f}k tokens/s; "
              f"{'dd cold' if before else 'cat'} {r['reference_bytes_per_s'] / 1e9:.2f} GB/s; "
              f"{100 * r['fraction']:.1f} % of {what}", flush=True)
    d["random_access"] = {"views_by_position": random_access(out, 200_000, False, False),
                          "views_by_id": random_access(out, 200_000, False, True),
                          "float32_record_by_position": random_access(out, 20_000, True, False)}
    for k, v in d["random_access"].items():
        print(f"random access, {k}: {v['sentences_per_s'] / 1e3:.0f}k sentences/s", flush=True)
    t = time.perf_counter()
    before = rss_kb()
    ElmoDataset(out)
    d["ElmoDataset_build"] = {"seconds": time.perf_counter() - t, "rss_growth_mb": (rss_kb() - before) / 1024}
    print(f"ElmoDataset build: {d['ElmoDataset_build']['seconds']:.1f} s, RSS +{d['ElmoDataset_build']['rss_growth_mb']:.0f} MB")
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=3000, help="lines of WikiText-2 valid.txt (default 3000: all)")
    ap.add_argument("--big-tokens", type=int, default=10_000_000)
    ap.add_argument("--slow-readers", action="store_true", help="also the per-sentence readers on HDF5")
    ap.add_argument("--out", default=os.path.join(RESULTS, "read_path.json"))
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    res = {"machine": machine(), "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30,
           "load_average_at_start": os.getloadavg(), "lines": args.lines, "one_process": True, "torch_threads": 1,
           "best_of": 3, "stream_batch_tokens": 2048,
           "method": "each row: best of 3 runs, each right after one cat (page cache) or, cold, after dd with "
                     "both preceded by posix_fadvise(DONTNEED); the reference is the best of those 3",
           "dtypes": {}}
    print(f"# read path, {res['machine']}, one process, 1 torch thread; each row best of 3, cat before each run")
    formats = "parquet,hdf5,arrow" if args.slow_readers else "parquet,arrow"
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        model, src = build_model(tmp, args.lines)
        for dtype in ("float16", "float32"):
            out = build_output(model, src, os.path.join(tmp, dtype), dtype, formats)
            res["dtypes"][dtype] = dtype_rows(out, dtype, args.slow_readers)
            shutil.rmtree(out)                           # out of the page cache before the next dtype
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        res["big_index"] = b = big_index(tmp, args.big_tokens)
        print(f"\n## index of a {b['tokens']}-token output ({b['sentences']} sentences): {b['index_bytes'] / 1e6:.1f} MB "
              f"({b['index_bytes_with_id_table'] / 1e6:.1f} MB with the id table), built in {b['index_build_s']:.1f} s "
              f"(+{b['id_table_build_s']:.1f} s); RSS +{b['rss_growth_index_mb']:.0f} MB, "
              f"+{b['rss_growth_after_100k_random_reads_mb']:.0f} MB after 100k random reads "
              f"({b['random_views_per_s'] / 1e3:.0f}k sentences/s), +{b['rss_growth_after_100k_id_lookups_mb']:.0f} MB "
              f"after 100k id lookups ({b['views_by_id_per_s'] / 1e3:.0f}k sentences/s): "
              f"{b['rss_bytes_per_sentence']:.0f} bytes a sentence")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
