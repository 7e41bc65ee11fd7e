"""How a corpus's work spreads over workers: the same text as 1 file and as N files (its lines dealt round-robin),
on FnApiRunner with 2 worker processes and on a 2-worker dask.distributed LocalCluster (1 thread each); wall
time and the CPU seconds of each worker (docs/scaling-out.md).

    python -m benchmarks.spread [--split valid|train] [--files 4] [--runners fnapi dask] [--repeat 1]

Each run is `python -m elmo_pipeline.pipeline.run` in a fresh process (shipped model, raw tokenizer, Parquet,
1 torch thread per worker). Worker CPU seconds: FnApiRunner's worker processes (each with its tokenizer
child) polled with psutil until they exit; Dask workers' getrusage before and after the run. The launcher's
own CPU (planning, Finalize) is in neither. Writes benchmarks/results/spread_<cpu>.json.
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
import threading
import time

from benchmarks.common import RESULTS, SHARED, kind_tag, machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASK = "apache_beam.runners.dask.dask_runner.DaskRunner"
BASE = ["--torch-threads", "1", "--progress", "off", "--format", "parquet"]


def corpora(folder: str, split: str, n: int) -> dict[str, str]:
    """{'1 file': glob, 'N files': glob}: WikiText-2 `split` as it is, and its lines dealt round-robin into n files."""
    src = os.path.join(SHARED, "data", "wikitext-2", f"{split}.txt")
    one, many = os.path.join(folder, "one"), os.path.join(folder, "many")
    os.makedirs(one)
    os.makedirs(many)
    shutil.copy(src, os.path.join(one, f"{split}.txt"))
    with open(src, "rb") as f:
        lines = f.read().split(b"\n")
    for k in range(n):
        with open(os.path.join(many, f"{split}.{k}.txt"), "wb") as f:
            f.write(b"\n".join(lines[k::n]))
    return {"1 file": os.path.join(one, "*.txt"), f"{n} files": os.path.join(many, "*.txt")}


def _tree_cpu(p) -> float:
    import psutil
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def run_fnapi(inp: str, out: str, workers: int) -> dict:
    """The run with FnApiRunner's multi_processing workers; each worker's CPU (its subtree), polled."""
    import psutil
    args = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", inp, "--output", out, *BASE,
            "--direct_num_workers", str(workers), "--direct_running_mode", "multi_processing"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launcher = psutil.Process(proc.pid)
    seen: dict[int, float] = {}
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                for c in launcher.children():
                    seen[c.pid] = max(seen.get(c.pid, 0.0), _tree_cpu(c))
            except psutil.Error:
                pass
            stop.wait(0.1)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    poller.join()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    cpu = sorted((s for s in seen.values() if s > 0.5), reverse=True)    # worker processes, not helpers
    return {"wall_s": wall, "worker_cpu_s": cpu, "summary": err.strip().splitlines()[-1]}


def run_dask(inp: str, out: str, client) -> dict:
    """The run on the cluster; each worker's CPU from getrusage before and after."""
    def usage():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    before = client.run(usage)
    args = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", inp, "--output", out, *BASE,
            "--runner", DASK, "--dask_client_address", client.scheduler_info()["address"]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    t0 = time.perf_counter()
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    after = client.run(usage)
    cpu = sorted((after[w] - before.get(w, 0.0) for w in after), reverse=True)
    return {"wall_s": wall, "worker_cpu_s": cpu, "summary": p.stderr.strip().splitlines()[-1]}


def _share(r: dict) -> float:
    cpu = r["worker_cpu_s"]
    return max(cpu) / sum(cpu) if cpu and sum(cpu) else float("nan")


def table(rows: list[dict]) -> str:
    lines = ["| runner | input | wall s | worker CPU s | busiest worker's share | wall / N files' |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['runner']} | {r['input']} | {r['wall_s']:.1f} | "
                     f"{' / '.join(f'{c:.1f}' for c in r['worker_cpu_s'])} | {100 * _share(r):.0f} % | "
                     f"{r.get('wall_vs_files', float('nan')):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("valid", "train", "test"), default="valid", help="WikiText-2 split")
    ap.add_argument("--files", type=int, default=4, help="files the N-file corpus deals the lines into")
    ap.add_argument("--runners", nargs="+", choices=("fnapi", "dask"), default=["fnapi", "dask"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration (the fastest is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out_path = args.out or os.path.join(RESULTS, f"spread_{args.split}_{kind_tag()}.json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = corpora(tmp, args.split, args.files)
        client = cluster = None
        if "dask" in args.runners:
            from distributed import Client, LocalCluster
            cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   dashboard_address=None, env={"OMP_NUM_THREADS": "1"})
            client = Client(cluster)
        try:
            if client is not None:      # the workers' imports and model load, once, before anything is timed
                warm = os.path.join(tmp, "warm-up.txt")
                with open(glob.glob(inputs["1 file"])[0], "rb") as src, open(warm, "wb") as f:
                    f.writelines(src.readlines()[:300])
                run_dask(warm, os.path.join(tmp, "warm-up"), client)
            for runner in args.runners:
                best: dict[str, dict] = {}
                for k in range(args.repeat):        # the inputs alternate, so that neither runs only first
                    for name, inp in (inputs.items() if k % 2 == 0 else reversed(inputs.items())):
                        out = os.path.join(tmp, f"out-{runner}-{name.replace(' ', '')}-{k}")
                        r = run_fnapi(inp, out, args.workers) if runner == "fnapi" else run_dask(inp, out, client)
                        r["load"] = os.getloadavg()
                        print(f"{runner:5} {name:8} wall {r['wall_s']:6.1f} s  worker CPU "
                              f"{[round(c, 1) for c in r['worker_cpu_s']]}  load {r['load'][0]:.2f}", flush=True)
                        if name not in best or r["wall_s"] < best[name]["wall_s"]:
                            best[name] = r
                rows += [{"runner": runner, "input": name, **best[name]} for name in inputs]
                files = [r for r in rows if r["runner"] == runner and r["input"] != "1 file"][0]
                for r in rows:
                    if r["runner"] == runner:
                        r["wall_vs_files"] = r["wall_s"] / files["wall_s"]
        finally:
            if client is not None:
                client.close()
                cluster.close()
    print(table(rows))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"machine": machine(), "split": args.split, "files": args.files, "workers": args.workers,
                   "rows": rows}, f, indent=1)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
