"""Peak RSS of the pipeline for a corpus and the same corpus 10 times larger: memory must stay flat.

Each run is its own process (local FnApiRunner, 1 worker); its peak RSS is the process's ru_maxrss.
    .venv/bin/python -m benchmarks.pipeline_memory [--input ../shared/data/wikitext-2/valid.txt] \
        [--scales 1 10] [--size tiny] [--threads 1] [pipeline flags, e.g. --shard-sentences 2000]
Prints a table; writes benchmarks/results/pipeline_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import RESULTS, SHARED, machine
from model.synthetic import write_random_bilm

CHILD = """
import json, resource, sys
from pipeline.run import counters, run
c = counters(run(sys.argv[1:]))
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "tokens": c["tokens"],
                  "sentences": c["sentences"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", default=os.path.join(SHARED, "data", "wikitext-2", "valid.txt"))
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--size", default="tiny", help="synthetic model (model/synthetic.py)")
    ap.add_argument("--threads", type=int, default=1)
    args, extra = ap.parse_known_args()   # anything else goes to the pipeline (e.g. --shard-sentences 2000)
    text = open(args.input, encoding="utf-8").read()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        options, weights = write_random_bilm(args.size, os.path.join(tmp, "model"))
        for scale in args.scales:
            inp = os.path.join(tmp, f"corpus-x{scale}.txt")
            with open(inp, "w", encoding="utf-8") as f:
                for _ in range(scale):
                    f.write(text)
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", CHILD, "--input", inp, "--output", os.path.join(tmp, f"out-x{scale}"),
                                "--options-file", options, "--weight-file", weights, "--torch-threads", str(args.threads),
                                "--progress", "off", *extra], capture_output=True, text=True)
            if r.returncode:
                sys.exit(r.stderr[-3000:])
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res.update(scale=scale, input_bytes=os.path.getsize(inp), wall_s=time.perf_counter() - t,
                       peak_rss_mb=res["maxrss_kb"] / 1024)
            rows.append(res)
            print(f"x{scale:<3} {res['input_bytes'] / 1e6:8.1f} MB input {res['tokens']:>9} tokens "
                  f"{res['wall_s']:7.1f} s  peak RSS {res['peak_rss_mb']:7.0f} MB", flush=True)
    growth = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"] - 1
    print(f"peak RSS growth x{rows[0]['scale']} -> x{rows[-1]['scale']}: {100 * growth:+.1f}%")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "pipeline_memory.json"), "w") as f:
        json.dump({"machine": machine(), "model": args.size, "pipeline_args": extra, "threads": args.threads, "rows": rows,
                   "peak_rss_growth": growth}, f, indent=2)


if __name__ == "__main__":
    main()
