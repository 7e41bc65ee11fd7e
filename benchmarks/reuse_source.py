"""A big --reuse source, built cheaply, and the peak RSS of a small run joining against it
(`python -m benchmarks.incremental --reuse-source-rows N`; docs/reuse.md).

The source is a real output of the tiny random model (model/synthetic.py) over the joining run's own input (so its
sentences are found and copied), plus filler shards written directly with pyarrow: each a valid sentence-layout
Parquet shard of one-token sentences (zero vectors of the model's widths, zstd) and its key index of random
sentence keys under the model's key prefix (which no sentence of the run has), listed in the manifest like any
shard. The joining run is measured against the source without filler and with it, on FnApiRunner with one worker
(in the launcher's process) and with 2 multi_processing workers; the difference over the filler rows is the join's
memory per source sentence.
"""
from __future__ import annotations

import binascii
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import RESULTS, kind_tag, machine, run, wiki_lines

ROWS_PER_SHARD = 20_000      # the default --shard-sentences: key-index files as a run writes them
FLAGS = ["--torch-threads", "1", "--progress", "off", "--format", "parquet", "--batch-invariant"]
RUNNERS = {"FnApiRunner, 1 worker in the launcher": [],
           "FnApiRunner, 2 multi_processing workers": ["--direct_num_workers", "2",
                                                       "--direct_running_mode", "multi_processing"]}


def random_keys(prefix: str, n: int, rng: np.random.Generator) -> pa.Array:
    """n sentence keys (prefix + 32 random hex digits) as a string array, built without a Python string each."""
    a = np.empty((n, len(prefix) + 32), np.uint8)
    a[:, : len(prefix)] = np.frombuffer(prefix.encode(), np.uint8)
    a[:, len(prefix):] = np.frombuffer(binascii.hexlify(rng.bytes(16 * n)), np.uint8).reshape(n, 32)
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(a.shape[1]), n, [None, pa.py_buffer(a.tobytes())])
    return fixed.cast(pa.binary()).cast(pa.string())


def add_filler(output: str, rows: int, seed: int = 0) -> int:
    """Append filler shards of `rows` one-token sentences in all to the finished output `output` (see the module
    docstring); returns the shards added."""
    from elmo_pipeline.formats.parquet import KEY_INDEX_SCHEMA, ShardColumns, build_table
    m = json.load(open(os.path.join(output, "manifest.json")))
    columns = list(m["layer_dims"].items())
    rng, k, left = np.random.default_rng(seed), 0, rows
    while left > 0:
        n = min(ROWS_PER_SHARD, left)
        ids = [f"filler{k:04d}:{r:08d}#0" for r in range(n)]
        c = ShardColumns(ids, [i[:-2] for i in ids], [0] * n, np.ones(n, np.int32), ["x"] * n,
                         np.zeros((n, 2), np.int32), [np.zeros((n, d), m["dtype"]) for _, d in columns])
        data, keys = f"parquet/filler-{k:04d}.parquet", f"keys/filler-{k:04d}.parquet"
        pq.write_table(build_table(c, "sentence", columns), os.path.join(output, data), compression="zstd")
        pq.write_table(pa.table([pa.array(ids, pa.string()), random_keys(m["key_index"]["key_prefix"], n, rng)],
                                schema=KEY_INDEX_SCHEMA), os.path.join(output, keys), compression="zstd")
        m["shards"].append({"parquet": data, "keys": keys, "sentences": n, "tokens": n})
        k, left = k + 1, left - n
    with open(os.path.join(output, "manifest.json"), "w") as f:
        json.dump(m, f)
    return k


def measure(args) -> int:
    from elmo_pipeline.model.synthetic import write_random_bilm
    out_path = args.out or os.path.join(RESULTS, f"reuse_source_{kind_tag()}.json")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        options, weights = write_random_bilm("tiny", os.path.join(tmp, "model"))
        model = ["--options-file", options, "--weight-file", weights]
        inp = os.path.join(tmp, "input.txt")
        with open(inp, "w", encoding="utf-8") as f:
            f.write("\n".join(wiki_lines("valid", args.lines or 300)))
        small = os.path.join(tmp, "source")
        run(["--input", inp, "--output", small, *model, *FLAGS])
        big = os.path.join(tmp, "big")
        shutil.copytree(small, big)
        t0 = time.perf_counter()
        shards = add_filler(big, args.reuse_source_rows, args.seed)
        built = time.perf_counter() - t0
        print(f"{machine()}; filler: {args.reuse_source_rows:,} sentences in {shards} shards, built in {built:.0f} s "
              f"({sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(big) for f in fs) / 1e6:.0f} MB)",
              flush=True)
        rows = []
        for runner, flags in RUNNERS.items():
            for name, source in (("run's own only", small), (args.reuse_source_rows, big)):
                r = run(["--input", inp, "--output", os.path.join(tmp, f"j{len(rows)}"), *model, *FLAGS, *flags,
                         "--reuse", source], children=bool(flags))
                rows.append({"runner": runner, "source_sentences": name, **r})
                print(f"{runner}: source {name!s:>14}: wall {r['wall_s']:6.1f} s  peak RSS {r['peak_rss_mb']:6.0f} MB"
                      + (f" (launcher {r['own_peak_rss_mb']:.0f} MB, children "
                         f"{[round(c) for c in r['children_peak_rss_mb']]} MB)" if flags else "")
                      + f"  {r['summary']}", flush=True)
        per = {runner: (b.get("own_peak_rss_mb", b["peak_rss_mb"]) - a.get("own_peak_rss_mb", a["peak_rss_mb"]))
                       * 2 ** 20 / args.reuse_source_rows
               for runner, (a, b) in zip(RUNNERS, zip(rows[::2], rows[1::2]))}
        for runner, v in per.items():
            print(f"{runner}: the launcher's peak RSS per source sentence: {v:.0f} bytes (it holds the join's groups)")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"machine": machine(), "flags": FLAGS, "filler_build_s": built, "rows": rows,
                   "launcher_bytes_per_source_sentence": per},
                  f, indent=1)
    print(f"wrote {out_path}")
    return 0
