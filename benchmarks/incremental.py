"""What a daily run costs when the corpus changed a little: day 2 (day 1 with 5 % of its documents edited, 2 % added,
1 % removed, seeded) as a full run, with `--reuse <day 1>` (docs/reuse.md), and as a change-only upsert into the
Iceberg table day 1 was registered in, without and with `--reuse-table` (docs/warehouses.md), whole processes side by
side, each as a share of the full day-2 run's wall; the floor measured beside them (process start-up and imports;
pyarrow reading day 1's shards and writing them again); the reuse output compared with the full one, bit for bit,
and each upserted table with the full one's shards (formats.iceberg.upsert.same_rows).

    python -m benchmarks.incremental [--lines N] [--size original] [--repeat 1]
    python -m benchmarks.incremental --reuse-source-rows 10000000      # peak RSS joining a big reuse source

Each run is `python -m elmo_pipeline.pipeline.run` in a fresh process: FnApiRunner, random weights of the
`--size` shape (model/synthetic.py), --torch-threads 2, --batch-invariant, Parquet. Day 1 is WikiText-2 valid as
JSONL, one document per non-blank line with a stable id (`valid-<line>`; `--lines N`: its first N lines), every run
reading it with --id-field id; added documents are lines of WikiText-2 test (`test-<line>`). Day 1 is run once into
a table (upsert, timed as context); each upsert row starts from a table of its own holding day 1 (day 1 upserted
into it with `--reuse <day 1>`, untimed). Peak RSS: ru_maxrss of the run's process (its waited-for children
included). Writes benchmarks/results/incremental_<cpu>.json (or reuse_source_<cpu>.json). CONFIGS lists the day-2
runs: a row is one more (name, extra flags, into a table) there.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from benchmarks.common import RESULTS, kind_tag, machine, run, wiki_lines
from elmo_pipeline.formats.iceberg import IcebergTarget
from tests.iceberg_rows import same_rows, upsert_argv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--torch-threads", "2", "--progress", "off", "--format", "parquet", "--batch-invariant"]
JSONL = ["--input-format", "jsonl", "--id-field", "id"]
# the day-2 runs, by name: extra flags ({day1}: day 1's output), whether an upsert into a table holding day 1; the
# first is the full run the others are shares of
CONFIGS = [("full day 2", [], False), ("day 2 --reuse day 1", ["--reuse", "{day1}"], False),
           ("day 2 upsert into day 1's table", [], True), ("day 2 upsert --reuse-table", ["--reuse-table"], True)]
EDITED, ADDED, REMOVED = 0.05, 0.02, 0.01


def documents(lines: list[str], split: str) -> list[tuple[str, str]]:
    """(id, text) of a document per non-blank line: id `<split>-<line index>`, the same every day."""
    return [(f"{split}-{k}", ln) for k, ln in enumerate(lines) if ln.strip()]


def next_day(docs: list[tuple[str, str]], new: list[tuple[str, str]], seed: int = 0) -> tuple[list, dict]:
    """Day 2 from day 1's documents (id, text): EDITED of them with one word replaced (same id), REMOVED of them
    dropped, ADDED as many again appended from `new` (no headings). Returns (documents, counts)."""
    rng = random.Random(seed)
    removed = set(rng.sample(range(len(docs)), round(REMOVED * len(docs))))
    edited = set(rng.sample([k for k in range(len(docs)) if k not in removed], round(EDITED * len(docs))))
    out = []
    for k, (i, ln) in enumerate(docs):
        if k in removed:
            continue
        if k in edited:
            words = ln.split(" ")
            spots = [j for j, w in enumerate(words) if w.strip()]
            words[rng.choice(spots)] = rng.choice(["river", "harbour", "edited", "yesterday"])
            ln = " ".join(words)
        out.append((i, ln))
    added = [d for d in new if not d[1].startswith(" =")][: round(ADDED * len(docs))]
    return out + added, {"documents": len(docs), "edited": len(edited), "removed": len(removed),
                         "added": len(added)}


def startup_seconds() -> float:
    """A fresh process importing the pipeline's graph (Beam, torch, pyarrow): what every run pays first."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import elmo_pipeline.pipeline.graph, elmo_pipeline.pipeline.run"],
                   cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), check=True)
    return time.perf_counter() - t0


def copy_floor(output: str, folder: str) -> dict:
    """pyarrow reading every Parquet shard of `output` and writing it again with the shards' settings: the least
    a full output built from stored vectors costs. Seconds and bytes."""
    from elmo_pipeline.formats.parquet import write_parquet
    import pyarrow.parquet as pq
    m = json.load(open(os.path.join(output, "manifest.json")))
    os.makedirs(folder, exist_ok=True)
    t0, nbytes = time.perf_counter(), 0
    for k, s in enumerate(m["shards"]):
        t = pq.read_table(os.path.join(output, s["parquet"]))
        nbytes += t.nbytes
        write_parquet(t, os.path.join(folder, f"{k}.parquet"), 64 << 20)
        del t
    return {"read_write_s": time.perf_counter() - t0, "vector_bytes": nbytes}


def digests(output: str) -> dict[str, str]:
    """{sentence id: sha256 of its doc id, tokens, offsets and every vector column's bytes}, shard by shard."""
    import pyarrow.parquet as pq
    m = json.load(open(os.path.join(output, "manifest.json")))
    out = {}
    for s in m["shards"]:
        t = pq.read_table(os.path.join(output, s["parquet"]))
        cols = [c for c in t.column_names if c != "id"]
        ids = t.column("id").to_pylist()
        flat = {c: t.column(c).combine_chunks() for c in cols}
        for r, sid in enumerate(ids):
            h = hashlib.sha256()
            for c in cols:
                v = flat[c][r]
                h.update(json.dumps(v.as_py()).encode() if not c.startswith(("layer_", "average")) else
                         v.values.flatten().to_numpy(zero_copy_only=False).tobytes())
            out[sid] = h.hexdigest()
        del t, flat
    return out


def table(rows: list[dict], floor: dict) -> str:
    lines = ["| run | wall s | share of full day 2 | peak RSS MB | summary |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['wall_s']:.1f} | {100 * r['share']:.1f} % | {r['peak_rss_mb']:.0f} | "
                     f"{r['summary'].split(': ', 1)[-1].split(' -> ')[0]} |")
    full = rows[0]["wall_s"]
    lines.append(f"| floor: start-up (imports) | {floor['startup_s']:.1f} | "
                 f"{100 * floor['startup_s'] / full:.1f} % | | |")
    lines.append(f"| floor: pyarrow read + write of day 1's shards ({floor['vector_bytes'] / 1e9:.2f} GB) | "
                 f"{floor['read_write_s']:.1f} | {100 * floor['read_write_s'] / full:.1f} % | | |")
    return "\n".join(lines)


def daily(args) -> int:
    from elmo_pipeline.model.synthetic import write_random_bilm
    out_path = args.out or os.path.join(RESULTS, f"incremental_{kind_tag()}.json")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        options, weights = write_random_bilm(args.size, os.path.join(tmp, "model"))
        model = ["--options-file", options, "--weight-file", weights]
        day1 = documents(wiki_lines("valid", args.lines), "valid")
        day2, changes = next_day(day1, documents(wiki_lines("test"), "test"), args.seed)
        paths = {}
        for name, docs in (("day1", day1), ("day2", day2)):
            paths[name] = os.path.join(tmp, f"{name}.jsonl")
            with open(paths[name], "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs)
        print(f"{machine()}; {args.size} shape, random weights; day 1: {changes['documents']} documents, day 2: "
              f"{changes['edited']} edited, {changes['added']} added, {changes['removed']} removed", flush=True)
        catalog = f"sqlite:///{tmp}/iceberg/catalog.db"
        one = os.path.join(tmp, "out-day1")
        first = run([*upsert_argv(paths["day1"], one, "bench.day1", catalog), *model, *BASE])
        print(f"day 1 into a table: {first['wall_s']:.1f} s  {first['summary']}", flush=True)
        best: dict[str, dict] = {}
        for k in range(args.repeat):          # the order alternates, so that neither runs only first
            for n, (name, extra, upsert) in enumerate(CONFIGS if k % 2 == 0 else CONFIGS[::-1]):
                out, into = os.path.join(tmp, f"out-{n}-{k}"), f"bench.day2_{n}_{k}"
                if upsert:                    # a table of its own holding day 1 (all of it reused: cheap)
                    prep = run([*upsert_argv(paths["day1"], out + "-day1", into, catalog), *model, *BASE,
                                "--reuse", one])
                    print(f"  (day 1 into {into}: {prep['wall_s']:.1f} s)", flush=True)
                    argv = upsert_argv(paths["day2"], out, into, catalog)
                else:
                    argv = ["--input", paths["day2"], *JSONL, "--output", out]
                r = run([*argv, *model, *BASE, *[e.format(day1=one) for e in extra]])
                r.update(output=out, table=into if upsert else None, load=os.getloadavg()[0])
                print(f"{name:24} wall {r['wall_s']:6.1f} s  peak RSS {r['peak_rss_mb']:6.0f} MB  load "
                      f"{r['load']:.2f}  {r['summary']}", flush=True)
                if name not in best or r["wall_s"] < best[name]["wall_s"]:
                    best[name] = r
        rows = [{"name": name, **best[name]} for name, _, _ in CONFIGS]
        for r in rows:
            r["share"] = r["wall_s"] / rows[0]["wall_s"]
        floor = {"startup_s": startup_seconds(), **copy_floor(one, os.path.join(tmp, "copy"))}
        ref = digests(rows[0]["output"])
        for r in rows[1:]:
            if r["table"]:
                r["equals_full"] = same_rows(IcebergTarget(r["table"], catalog), rows[0]["output"])
                print(f"{r['name']}: table {r['table']} {'equals' if r['equals_full'] else 'DIFFERS FROM'} the full "
                      "day-2 run's shards (every row by id, every value; vectors bit for bit)", flush=True)
                continue
            r["equals_full"] = digests(r["output"]) == ref
            print(f"{r['name']}: output {'equals' if r['equals_full'] else 'DIFFERS FROM'} the full day-2 run's "
                  f"({len(ref)} sentences; ids, tokens, offsets, vectors bit for bit)", flush=True)
        for r in rows:
            del r["output"], r["table"]
    print(table(rows, floor))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"machine": machine(), "size": args.size, "lines": args.lines or "all", "seed": args.seed,
                   "input": "JSONL, a document per non-blank line, --id-field id", "flags": BASE,
                   "changes": changes, "day1": first, "rows": rows, "floor": floor}, f, indent=1)
    print(f"wrote {out_path}")
    return 0 if all(r.get("equals_full", True) for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=0, help="use the first N lines of WikiText-2 valid (default: all)")
    ap.add_argument("--size", default="original", help="synthetic model shape (model/synthetic.py; default original)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each day-2 configuration (the fastest is kept)")
    ap.add_argument("--reuse-source-rows", type=int, default=0,
                    help="instead: build a reuse source of this many sentences and measure a joining run's peak RSS")
    ap.add_argument("--tmp", default=None, help="folder for the temporary outputs (default: the system's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.reuse_source_rows:
        from benchmarks.reuse_source import measure
        return measure(args)
    return daily(args)


if __name__ == "__main__":
    sys.exit(main())
