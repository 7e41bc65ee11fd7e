"""Do --batch-invariant pipeline outputs hash the same at every budget and thread count here?

    python scripts/invariant_hashes.py [--lines 300] [--budgets 512 4096 16384] [--threads 1 2]
                                       [--dtypes float32 bfloat16] [--shape small|medium|original] [--out DIR]

Runs `pipeline.run --batch-invariant` (Parquet and HDF5, one shard unless --shard-bytes ends one: a wide model's)
on the first --lines lines of WikiText-2 valid (../shared/data) for each compute dtype, torch thread count and token
budget, with the shipped model or, with --shape, random weights of a published shape (model/synthetic.py, written
once). Each output's files are first checked against its manifest's records (size and SHA-256). Its vectors' digest
is the SHA-256 of every Parquet row sorted by id (every column, each layer's values bit for bit) and of every HDF5
dataset sorted by name (its name, dtype, shape and values bit for bit); per dtype, every run's must equal the first
run's. Whether the shard files themselves hash the same is shown beside it (they do when
the runs wrote the same shards: a shard cut by bytes holds the sentences in the order they arrived). Prints a table
(the machine named) and, with --json FILE, the same as JSON; exit status 0 when every dtype's runs give the same
vectors, 1 when some differ, 2 when a run fails. --out keeps the outputs (default: a temp folder, removed).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import fsspec
import h5py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import machine, wiki_lines  # noqa: E402
from elmo_pipeline.fsio.cache import file_sha256 as sha256  # noqa: E402
from elmo_pipeline.fsio.fs import read_json  # noqa: E402


def column_bytes(col) -> bytes:
    """A column's values as bytes: its null mask, each list level's lengths, then the leaf values (strings each
    prefixed with its length)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    parts = [pc.is_null(col).to_numpy(zero_copy_only=False).tobytes()]
    while pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
        parts.append(pc.list_value_length(col).to_numpy(zero_copy_only=False).tobytes())
        col = pc.list_flatten(col)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        parts += [len(b).to_bytes(8, "little") + b for b in (v.encode("utf-8") for v in col.fill_null("").to_pylist())]
    else:
        parts.append(col.fill_null(0).to_numpy(zero_copy_only=False).tobytes())
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def digests(out: str) -> dict[str, str]:
    """The vectors' digest (every Parquet row sorted by id, every HDF5 dataset by name) and the shard files'
    SHA-256, after checking every file the manifest records against its record."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    manifest = read_json(fsspec.filesystem("file"), os.path.join(out, "manifest.json"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise SystemExit(f"error: {out}: no readable manifest.json")
    for name, rec in manifest["files"].items():
        path = os.path.join(out, name)
        if os.path.getsize(path) != rec["bytes"] or sha256(path) != rec["sha256"]:
            raise SystemExit(f"error: {path} is not the file its manifest records")
    shards = [s[fmt] for s in manifest["shards"] for fmt in ("parquet", "hdf5")]
    if any(name not in manifest["files"] for name in shards):
        raise SystemExit(f"error: {out}: a shard the manifest names has no file record")
    table = pa.concat_tables([pq.read_table(os.path.join(out, s["parquet"])) for s in manifest["shards"]])
    table = table.sort_by([("id", "ascending")])
    h = hashlib.sha256()
    for name in sorted(table.column_names):                  # every column: ids, tokens, offsets, each layer
        h.update(len(name).to_bytes(8, "little") + name.encode() + column_bytes(table.column(name)))
    datasets = {}                                               # HDF5: every dataset of every shard, by name
    for s in manifest["shards"]:
        with h5py.File(os.path.join(out, s["hdf5"]), "r") as f:
            for name, ds in f.items():
                if name in datasets or not isinstance(ds, h5py.Dataset):
                    raise SystemExit(f"error: {out}: HDF5 {name!r} twice or not a dataset")
                head = f"{name}|{ds.dtype.str}|{ds.shape}|".encode()
                datasets[name] = hashlib.sha256(head + ds[()].tobytes()).digest()
    for name in sorted(datasets):
        h.update(datasets[name])
    files = ",".join(manifest["files"][name]["sha256"] for name in shards)        # checked above
    return {"vectors": h.hexdigest(), "files": hashlib.sha256(files.encode()).hexdigest()}


def run(inp: str, out: str, dtype: str, threads: int, budget: int, model: list[str]) -> None:
    cmd = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", inp, "--output", out, "--batch-invariant",
           "--compute-dtype", dtype, "--torch-threads", str(threads), "--max-tokens-per-batch", str(budget),
           "--shard-sentences", "1000000", "--format", "parquet,hdf5", "--progress", "off", *model]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if p.returncode:
        sys.stderr.write(p.stderr[-2000:])
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--shape", choices=["small", "medium", "original"])
    ap.add_argument("--out")
    ap.add_argument("--json", help="also write the table here, naming the machine and the command")
    args = ap.parse_args(argv)
    tmp = args.out or tempfile.mkdtemp(prefix="invariant-hashes-")
    try:
        os.makedirs(tmp, exist_ok=True)
        inp = os.path.join(tmp, "input.txt")
        with open(inp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in wiki_lines("valid", args.lines)))
        model = []
        if args.shape:
            from elmo_pipeline.model.synthetic import write_random_bilm
            options, weights = write_random_bilm(args.shape, os.path.join(tmp, "model"))
            model = ["--options-file", options, "--weight-file", weights]
        print(f"{machine()}; {args.lines} lines of WikiText-2 valid, {args.shape or 'the shipped'} model")
        print(f"{'dtype':<10}{'threads':>8}{'budget':>8}  {'vectors sha256':<18}{'same':<6}{'shard files':<18}same")
        bad, rows = False, []
        for dtype in args.dtypes:
            first = None
            for threads in args.threads:
                for budget in args.budgets:
                    out = os.path.join(tmp, f"{dtype}-{threads}t-{budget}")
                    run(inp, out, dtype, threads, budget, model)
                    got = digests(out)
                    first = first or got
                    same = got["vectors"] == first["vectors"]
                    bad |= not same
                    rows.append({"dtype": dtype, "threads": threads, "budget": budget, **got, "same_vectors": same,
                                 "same_files": got["files"] == first["files"]})
                    print(f"{dtype:<10}{threads:>8}{budget:>8}  {got['vectors'][:16]:<18}{'yes' if same else 'NO':<6}"
                          f"{got['files'][:16]:<18}{'yes' if got['files'] == first['files'] else 'no'}", flush=True)
        print("every dtype's runs give the same vectors" if not bad else "DIFFERENT vectors within a dtype")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "command": "python scripts/invariant_hashes.py " + " ".join(
                    sys.argv[1:] if argv is None else argv), "lines": args.lines, "model": args.shape or "shipped",
                    "rows": rows, "same_vectors": not bad}, f, indent=2)
        return 1 if bad else 0
    finally:
        if not args.out:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
