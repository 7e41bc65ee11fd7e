"""The read path of downstream training, every reader and layout against the page-cache bandwidth of the same run.

    python -m benchmarks.read_path [--lines 3000] [--big-tokens 10000000] [--out benchmarks/results/read_path.json]

Outputs of WikiText-2 valid (its first --lines lines) are written by the pipeline with a near-free biLM as
wide as the original (benchmarks/host_cost.WIDE_CHEAP), fp16 and fp32, --format parquet,hdf5,arrow. Per dtype:
`cat` of the files (the page-cache bandwidth), `dd` of the arrow files after posix_fadvise(DONTNEED) (cold),
then each reader streaming every sentence; each reader's rate is in stored bytes of the vectors it read per
second, its line ending in "NN.N % of page-cache bandwidth". MappedDataset: padded batches of 32 (length
buckets), all layers and the top layer; random access by position and by id (views, and with a copy).
The index's memory: a --big-tokens output of synthetic vectors (one 64-wide float16 layer: the index does
not depend on the width) written by formats.arrow, RSS after the index is built and after random reads.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
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


def cat_rate(files: list[str], runs: int = 3) -> float:
    """Best bytes/s of `cat` of the files to /dev/null (page cache warm after the first)."""
    best = 0.0
    for _ in range(runs + 1):
        t = time.perf_counter()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        best = max(best, _size(files) / (time.perf_counter() - t))
    return best


def drop_cache(files: list[str]) -> None:
    """The files' pages out of the page cache (fsync, then POSIX_FADV_DONTNEED: no privileges needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def dd_cold_rate(files: list[str]) -> float:
    drop_cache(files)
    t = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M"], stderr=subprocess.DEVNULL, check=True)
    return _size(files) / (time.perf_counter() - t)


def timed(fn, best_of: int = 2) -> tuple[float, int]:
    """(best seconds, what fn returned: bytes read) over best_of runs."""
    best, n = float("inf"), 0
    for _ in range(best_of):
        t = time.perf_counter()
        n = fn()
        best = min(best, time.perf_counter() - t)
    return best, n


def stream_mapped(out: str, layers, dtype) -> int:
    """Every sentence, padded batches of 32 in length buckets (every stored byte copied out of the mapped file
    into a batch tensor); returns stored vector bytes read."""
    from downstream.mapped import BucketBatchSampler, MappedDataset
    ds = MappedDataset(out, layers=layers, tokens=False, dtype=dtype)
    item = ds.stored_dtype.itemsize
    width = sum(ds.widths)
    total = 0
    for b in ds.batches(BucketBatchSampler(ds.lengths, batch_size=32)):
        total += int(b["lengths"].sum()) * width * item
    return total


def stream_records(out: str, fmt: str, layers, iterable: bool) -> int:
    from downstream.readers import ElmoDataset, ElmoIterableDataset, collate
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


def random_access(out: str, n: int, copy: bool, by_id: bool) -> dict:
    """Random lookups from the page cache: sentences/s (views of all layers, or a float32 record with copy)."""
    from downstream.mapped import MappedDataset
    ds = MappedDataset(out, tokens=False)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(ds), n).tolist()
    ids = [ds._meta(p)["id"] for p in picks] if by_id else None
    for p in picks[:1000]:
        ds.views(p)
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
    return {"sentences_per_s": n / (time.perf_counter() - t), "lookups": n}


def build_outputs(tmp: str, lines: int) -> dict[str, str]:
    from benchmarks.host_cost import WIDE_CHEAP
    from model.synthetic import write_random_bilm
    model = write_random_bilm(WIDE_CHEAP, os.path.join(tmp, "model"))
    with open(os.path.join(SHARED, "data", "wikitext-2", "valid.txt"), encoding="utf-8", newline="\n") as f:
        text = [next(f, "") for _ in range(lines)]
    src = os.path.join(tmp, "valid.txt")
    with open(src, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(text)
    outs = {}
    for dtype in ("float16", "float32"):
        outs[dtype] = os.path.join(tmp, dtype)
        subprocess.run([sys.executable, "-m", "pipeline.run", "--input", src, "--output", outs[dtype],
                        "--options-file", model[0], "--weight-file", model[1], "--torch-threads", "1",
                        "--progress", "off", "--format", "parquet,hdf5,arrow", "--dtype", dtype],
                       check=True, capture_output=True)
    return outs


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def big_index(tmp: str, tokens: int, shard_tokens: int = 1_000_000) -> dict:
    """RSS of a MappedDataset over a `tokens`-token arrow output of synthetic vectors (20-token sentences)."""
    from downstream.mapped import MappedDataset
    from formats.arrow import arrow_table, write_arrow
    from formats.layout import ARROW_LAYOUT, MANIFEST
    from formats.parquet import ShardColumns
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
    after_index = rss_kb()
    picks = np.random.default_rng(1).integers(0, len(ds), 100_000).tolist()
    t = time.perf_counter()
    for p in picks:
        ds.views(p)
    rate = len(picks) / (time.perf_counter() - t)
    after_reads = rss_kb()
    return {"tokens": tokens, "sentences": len(ds), "file_bytes": size, "index_bytes": ds.index_bytes(),
            "index_build_s": build_s, "rss_growth_index_mb": (after_index - before) / 1024,
            "rss_growth_after_100k_random_reads_mb": (after_reads - before) / 1024,
            "random_views_per_s": rate, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=3000, help="lines of WikiText-2 valid.txt (default 3000: all)")
    ap.add_argument("--big-tokens", type=int, default=10_000_000)
    ap.add_argument("--slow-readers", action="store_true", help="also the per-sentence readers on HDF5")
    ap.add_argument("--out", default=os.path.join(RESULTS, "read_path.json"))
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    res = {"machine": machine(), "lines": args.lines, "one_process": True, "torch_threads": 1, "dtypes": {}}
    print(f"# read path, {res['machine']}, one process, 1 torch thread")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        outs = build_outputs(tmp, args.lines)
        for dtype, out in outs.items():
            from downstream.readers import ElmoOutput
            o = ElmoOutput(out)
            top = [o.layer_names[-1]]
            sizes = {fmt: _size(_files(out, fmt)) for fmt in ("parquet", "hdf5", "arrow")}
            cold = dd_cold_rate(_files(out, "arrow"))
            bw = cat_rate(_files(out, "parquet") + _files(out, "arrow"))
            d = {"tokens": o.manifest["counts"]["tokens_written"], "sentences": o.num_sentences, "file_bytes": sizes,
                 "cat_bytes_per_s": bw, "dd_cold_arrow_bytes_per_s": cold, "rows": {}}
            print(f"\n## {dtype}: {d['tokens']} tokens, {d['sentences']} sentences; files {sizes}")
            print(f"cat (parquet + arrow files): {bw / 1e9:.2f} GB/s; dd of the arrow files, cold: {cold / 1e9:.2f} GB/s")
            drop_cache(_files(out, "arrow"))
            t0 = time.perf_counter()
            n = stream_mapped(out, None, None)
            cold_s = time.perf_counter() - t0
            d["rows"]["MappedDataset (arrow), all layers, stored dtype, cold cache"] = \
                {"seconds": cold_s, "bytes": n, "vs": "dd_cold", "fraction": n / cold_s / cold}
            rows = {
                "MappedDataset (arrow), all layers, stored dtype": lambda: stream_mapped(out, None, None),
                "MappedDataset (arrow), top layer, stored dtype": lambda: stream_mapped(out, top, None),
                "MappedDataset (arrow), all layers, float32 tensors": lambda: stream_mapped(out, None, "float32"),
                "pyarrow read_table of the vector columns (parquet)": lambda: pyarrow_columns(out, o.layer_names),
                "ElmoIterableDataset (parquet) + collate": lambda: stream_records(out, "parquet", None, True),
                "ElmoIterableDataset (arrow) + collate": lambda: stream_records(out, "arrow", None, True),
            }
            if args.slow_readers:
                rows["ElmoIterableDataset (hdf5) + collate"] = lambda: stream_records(out, "hdf5", None, True)
            for name, fn in rows.items():
                s, n = timed(fn, best_of=2 if name.startswith("Mapped") else 1)
                d["rows"][name] = {"seconds": s, "bytes": n, "vs": "cat", "fraction": n / s / bw}
            for name, r in d["rows"].items():
                ref = "page-cache bandwidth" if r["vs"] == "cat" else "cold dd bandwidth"
                r["tokens_per_s"] = d["tokens"] / r["seconds"]
                print(f"{name}: {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, {r['tokens_per_s'] / 1e3:.0f}k tokens/s, "
                      f"{100 * r['fraction']:.1f} % of {ref}")
            t = time.perf_counter()
            from downstream.readers import ElmoDataset
            before = rss_kb()
            ElmoDataset(out)
            d["ElmoDataset_build"] = {"seconds": time.perf_counter() - t, "rss_growth_mb": (rss_kb() - before) / 1024}
            d["random_access"] = {"views_by_position": random_access(out, 200_000, False, False),
                                  "views_by_id": random_access(out, 50_000, False, True),
                                  "float32_record_by_position": random_access(out, 20_000, True, False)}
            for k, v in d["random_access"].items():
                print(f"random access, {k}: {v['sentences_per_s'] / 1e3:.0f}k sentences/s")
            print(f"ElmoDataset build: {d['ElmoDataset_build']['seconds']:.1f} s, RSS +{d['ElmoDataset_build']['rss_growth_mb']:.0f} MB")
            res["dtypes"][dtype] = d
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        res["big_index"] = big_index(tmp, args.big_tokens)
        b = res["big_index"]
        print(f"\n## index of a {b['tokens']}-token output ({b['sentences']} sentences): {b['index_bytes'] / 1e6:.1f} MB, "
              f"built in {b['index_build_s']:.1f} s; RSS +{b['rss_growth_index_mb']:.0f} MB, +"
              f"{b['rss_growth_after_100k_random_reads_mb']:.0f} MB after 100k random reads "
              f"({b['random_views_per_s'] / 1e3:.0f}k sentences/s)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
