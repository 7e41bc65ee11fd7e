"""Peak RSS of the pipeline for a corpus and the same corpus 10 times larger: memory must stay flat.

Each run is its own process (local FnApiRunner, 1 worker); its peak RSS is the process's ru_maxrss.
    .venv/bin/python -m benchmarks.pipeline_memory [--input ../shared/data/wikitext-2/valid.txt] \
        [--scales 1 10] [--size tiny] [--threads 1] [pipeline flags, e.g. --shard-sentences 2000]
Prints a table; writes benchmarks/results/pipeline_memory.json.

--bomb MIB: instead, hostile single lines between two good ones: a .gz that expands to one line of MIB MiB
without spaces (a dead letter past --max-record-bytes, read in blocks), and a line just under the cap (the most
one record may take, embedded), beside the two good lines alone; writes pipeline_memory_bomb.json.
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
from elmo_pipeline.model.synthetic import write_random_bilm

CHILD = """
import json, resource, sys
from elmo_pipeline.pipeline.run import counters, run
c = counters(run(sys.argv[1:]))
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "tokens": c["tokens"],
                  "sentences": c["sentences"]}))
"""


def _child(inp: str, out: str, options: str, weights: str, threads: int, extra: list[str]) -> dict:
    """One pipeline run in its own process: its counters, wall time and peak RSS (MB)."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, "--input", inp, "--output", out, "--options-file", options,
                        "--weight-file", weights, "--torch-threads", str(threads), "--progress", "off", *extra],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res.update(input_bytes=os.path.getsize(inp), wall_s=time.perf_counter() - t, peak_rss_mb=res["maxrss_kb"] / 1024)
    return res


def bomb(mib: int, size: str, threads: int, extra: list[str]) -> None:
    """Peak RSS with a decompression bomb (one line of `mib` MiB from a small .gz) and with a line just under
    --max-record-bytes, each between two good lines, against the good lines alone."""
    import gzip
    from elmo_pipeline.transforms.read import MAX_RECORD_BYTES
    cap = int(extra[extra.index("--max-record-bytes") + 1]) if "--max-record-bytes" in extra else MAX_RECORD_BYTES
    good, block = b"A first good line.\n", b"x" * (1 << 20)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        options, weights = write_random_bilm(size, os.path.join(tmp, "model"))
        cases = {"good lines only": (b"", ".txt"), f"gz bomb: one {mib} MiB line": (None, ".txt.gz"),
                 f"one line of {cap - 1} bytes (cap - 1)": (b"y" * (cap - 1) + b"\n", ".txt")}
        for name, (middle, suffix) in cases.items():
            inp = os.path.join(tmp, f"case-{len(rows)}{suffix}")
            if middle is None:          # written in blocks: the benchmark itself never holds the line
                with gzip.open(inp, "wb", compresslevel=9) as f:
                    f.write(good)
                    for _ in range(mib):
                        f.write(block)
                    f.write(b"\nA last good line.\n")
            else:
                with open(inp, "wb") as f:
                    f.write(good + middle + b"A last good line.\n")
            res = _child(inp, os.path.join(tmp, f"out-{len(rows)}"), options, weights, threads, extra)
            res.update(case=name, expanded_bytes=len(good) + (mib << 20) + 19 if middle is None else None)
            rows.append(res)
            print(f"{name:<34} {res['input_bytes'] / 1e6:9.3f} MB input {res['sentences']:>3} sentences "
                  f"{res['wall_s']:6.1f} s  peak RSS {res['peak_rss_mb']:7.0f} MB", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "pipeline_memory_bomb.json"), "w") as f:
        json.dump({"machine": machine(), "model": size, "pipeline_args": extra, "threads": threads,
                   "max_record_bytes": cap, "rows": rows}, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", default=os.path.join(SHARED, "data", "wikitext-2", "valid.txt"))
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--size", default="tiny", help="synthetic model (model/synthetic.py)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bomb", type=int, default=None, metavar="MIB",
                    help="hostile lines instead of the corpus: a .gz expanding to one MIB MiB line, ...")
    args, extra = ap.parse_known_args()   # anything else goes to the pipeline (e.g. --shard-sentences 2000)
    if args.bomb:
        return bomb(args.bomb, args.size, args.threads, extra)
    text = open(args.input, encoding="utf-8").read()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        options, weights = write_random_bilm(args.size, os.path.join(tmp, "model"))
        for scale in args.scales:
            inp = os.path.join(tmp, f"corpus-x{scale}.txt")
            with open(inp, "w", encoding="utf-8") as f:
                for _ in range(scale):
                    f.write(text)
            res = _child(inp, os.path.join(tmp, f"out-x{scale}"), options, weights, args.threads, extra)
            res["scale"] = scale
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
