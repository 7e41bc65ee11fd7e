"""What a lower compute dtype costs in quality, on the repo's own tasks with the shipped model: bf16 vs fp32.

Both tasks run twice, vectors computed with --compute-dtype float32 and with the lower dtype (everything else
the same), and are probed the same way (same seeds):
  sst2      SST-2 sentences through the pipeline (docs/downstream.md "SST-2 with the shipped default model":
            python -m elmo_pipeline.pipeline.run ... --compute-dtype D, stateless, 1 torch thread), then
            `elmo-pipeline probe --classifier linear --settings layers,mix-trainable,mix-frozen --seeds N`
  nextword  WikiText-2 next-word-class token task (next_word_task, below) through the embedder
            (ElmoEmbedder(dtype=D)), the probe's linear tagger (L-BFGS) per layer, N seeds
and per output layer the relative error ||v_D - v_fp32|| / ||v_fp32|| (Frobenius over all real tokens of the
task's vectors, as benchmarks/model_speed.py measures it on a random biLM).

    python -m benchmarks.bf16_quality [--dtype bfloat16] [--seeds 2] [--tasks sst2,nextword] [--device cuda] [--tag NAME]
Prints the table; writes benchmarks/results/bf16_quality[_TAG].json (machine, CPU support, every score).
Intermediate outputs go to out/bf16_quality/<device>/ (a finished pipeline output is reused: the pipeline skips it).
--device: where the vectors are computed (the pipeline's --device and the embedder's; default cpu); the probes train
on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch

from benchmarks.common import HERE, RESULTS, SHARED, machine

ROOT = os.path.dirname(HERE)
SST2_SETTINGS = "layers,mix-trainable,mix-frozen"


class LayerError:
    """Accumulates per-layer ||low - ref||^2 and ||ref||^2 over pairs of (L, T, D) arrays."""

    def __init__(self):
        self.num = self.den = None

    def add(self, ref: np.ndarray, low: np.ndarray) -> None:
        a, b = ref.astype(np.float64), low.astype(np.float64)
        d, r = ((b - a) ** 2).sum(axis=(1, 2)), (a ** 2).sum(axis=(1, 2))
        self.num, self.den = (d, r) if self.num is None else (self.num + d, self.den + r)

    def result(self) -> list[float]:
        return (np.sqrt(self.num) / np.sqrt(self.den)).tolist()


def run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def sst2(work: str, dtypes: list[str], seeds: int, source: str, limit: int | None = None, device: str = "cpu") -> dict:
    from elmo_pipeline.downstream.readers import ElmoOutput
    data = os.path.join(work, "sst2", "data")
    run([sys.executable, "-m", "elmo_pipeline.downstream.sst2", source, data, *(["--limit", str(limit)] if limit else [])])
    out: dict = {"dtypes": {}, "command": f"elmo-pipeline probe --classifier linear --settings {SST2_SETTINGS} "
                                            f"--seeds {seeds} --threads 1"}
    for dt in dtypes:
        t0 = time.perf_counter()
        for s in ("train", "dev", "test"):
            run([sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", f"{data}/{s}.jsonl", "--input-format", "jsonl",
                 "--id-field", "id", "--tokenizer", "whitespace", "--output", f"{work}/sst2/{dt}/{s}",
                 "--shard-sentences", "2000", "--torch-threads", "1", "--progress", "off", "--compute-dtype", dt,
                 "--device", device])
        extract_s = time.perf_counter() - t0
        labels = [a for s in ("train", "dev", "test") for a in ("--labels", f"{data}/{s}.jsonl")]
        probe = f"{work}/sst2/{dt}/probe-linear"
        run([sys.executable, "-m", "elmo_pipeline.pipeline.probe_command", "--train", f"{work}/sst2/{dt}/train",
             "--dev", f"{work}/sst2/{dt}/dev", "--test", f"{work}/sst2/{dt}/test", *labels, "--classifier", "linear",
             "--settings", SST2_SETTINGS, "--seeds", str(seeds), "--threads", "1", "--quiet", "--out", probe])
        with open(f"{probe}/results.json") as f:
            res = json.load(f)
        out["dtypes"][dt] = {"extract_seconds": round(extract_s, 1), "summary": res["summary"], "runs": res["runs"]}
    for dt in dtypes[1:]:
        err = LayerError()
        for s in ("train", "dev", "test"):
            ref = {r["id"]: r["layers"] for r in ElmoOutput(f"{work}/sst2/{dtypes[0]}/{s}").sentences()}
            for r in ElmoOutput(f"{work}/sst2/{dt}/{s}").sentences():
                err.add(ref[r["id"]], r["layers"])
        out["dtypes"][dt]["relative_error_per_layer"] = err.result()
    return out


# The next-word-class token task: each token tagged with the word class of the NEXT token, so contextual layers
# matter. Train: the first 2,500 sentences of valid.txt; dev: test.txt sentences 1-600; test: 601-1,800.
CLOSED = {"DET": {"the", "a", "an", "this", "that", "these", "those"},
          "PREP": {"of", "in", "to", "for", "on", "with", "by", "at", "from", "as", "into", "after", "during", "between"},
          "PRON": {"he", "she", "it", "they", "his", "her", "its", "their", "i", "we", "you", "him", "them", "which", "who"},
          "CONJ": {"and", "or", "but"},
          "AUX": {"is", "was", "are", "were", "be", "been", "has", "have", "had", "will", "would", "can", "could"}}


def word_class(token: str | None) -> str:
    """The next-word task's class of a token (None: the end of the sentence)."""
    if token is None:
        return "END"
    if token == "<unk>":
        return "UNK"
    if re.fullmatch(r"\W+", token) or token.startswith("@"):
        return "PUNCT"
    if re.fullmatch(r"[\d.,]+", token):
        return "NUM"
    for name, words in CLOSED.items():
        if token.lower() in words:
            return name
    if token[0].isupper():
        return "CAP"
    return next(("-" + s for s in ("ly", "ing", "ed", "s") if token.lower().endswith(s)), "OTHER")


def sentences(path: str) -> list[list[str]]:
    """A WikiText-2 file's sentences (cut at "."), headings left out."""
    out = []
    for line in open(path, encoding="utf-8"):
        toks = line.split()
        if not toks or toks[0] == "=":
            continue
        cur = []
        for t in toks:
            cur.append(t)
            if t == ".":
                out.append(cur)
                cur = []
        if cur:
            out.append(cur)
    return out


def next_word_task(wikitext: str) -> tuple[dict, list[str]]:
    """The task's splits {train, dev, test: [{"tokens", "tags"}]} and its classes (tags index them)."""
    valid, test = sentences(os.path.join(wikitext, "valid.txt")), sentences(os.path.join(wikitext, "test.txt"))
    parts = {"train": valid[:2500], "dev": test[:600], "test": test[600:1800]}
    classes = sorted({word_class(t) for s in valid for t in s} | {"END"})
    return {name: [{"tokens": s, "tags": [classes.index(word_class(s[i + 1] if i + 1 < len(s) else None))
                                          for i in range(len(s))]} for s in sents]
            for name, sents in parts.items()}, classes


def embed_task(emb, records: list[dict]) -> list[dict]:
    """The records with their "layers" (the embedder's vectors of "tokens")."""
    vectors = emb.embed_sentences([r["tokens"] for r in records], max_tokens=8192)
    return [{**r, "layers": v} for r, v in zip(records, vectors)]


def nextword(dtypes: list[str], seeds: int, wikitext: str, limit: int | None = None, device: str = "cpu") -> dict:
    from elmo_pipeline.downstream.probe import ProbeConfig, Split, train_setting
    from elmo_pipeline.model.embedder import ElmoEmbedder
    parts, classes = next_word_task(wikitext)
    parts = {k: v[:limit] for k, v in parts.items()} if limit else parts
    out: dict = {"dtypes": {}, "classes": classes,
                 "tokens": {k: sum(len(r["tags"]) for r in v) for k, v in parts.items()}}
    ref = None
    for dt in dtypes:
        emb = ElmoEmbedder(dtype=dt, device=device)
        t0 = time.perf_counter()
        recs = {name: embed_task(emb, rs) for name, rs in parts.items()}
        entry: dict = {"embed_seconds": round(time.perf_counter() - t0, 1)}
        if ref is None:
            ref = {name: [r["layers"] for r in rs] for name, rs in recs.items()}
        else:
            err = LayerError()
            for name, rs in recs.items():
                for a, r in zip(ref[name], rs):
                    err.add(a, r["layers"])
            entry["relative_error_per_layer"] = err.result()
        splits = {name: Split(name, rs).prepare("token") for name, rs in recs.items()}
        stats = splits["train"].token_stats()
        runs = []
        for layer in range(emb.n_layers):
            for seed in range(seeds):
                cfg = ProbeConfig(task="token", classes=list(range(len(classes))), stats=stats, seed=seed)
                r = train_setting(f"layer{layer}", cfg, splits["train"], splits["dev"], splits["test"],
                                  emb.n_layers, emb.output_dim)
                r["seed"] = seed
                runs.append(r)
                print(f"nextword {dt} layer{layer} seed {seed}: test {100 * r['test']['accuracy']:.2f}",
                      file=sys.stderr, flush=True)
        entry["runs"] = runs
        out["dtypes"][dt] = entry
        del splits, recs
    return out


def rows(task: str, result: dict, dtypes: list[str]) -> list[dict]:
    """One row per setting: test accuracy (%) per dtype (mean over seeds, seed spread), the difference."""
    by = {dt: {} for dt in dtypes}
    for dt in dtypes:
        for r in result["dtypes"][dt]["runs"]:
            by[dt].setdefault(r["setting"], []).append(100 * r["test"]["accuracy"])
    table = []
    for setting in by[dtypes[0]]:
        row = {"task": task, "setting": setting}
        for dt in dtypes:
            v = np.array(by[dt][setting])
            row[dt] = round(float(v.mean()), 2)
            row[f"{dt}_spread"] = round(float(v.max() - v.min()), 2)
        row["difference"] = round(row[dtypes[1]] - row[dtypes[0]], 2)
        table.append(row)
    return table


def markdown(table: list[dict], errors: dict, dtypes: list[str]) -> str:
    low = dtypes[1]
    lines = [f"| task | setting | {dtypes[0]} test acc (seed spread) | {low} test acc (seed spread) | difference |",
             "|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['task']} | {r['setting']} | {r[dtypes[0]]:.2f} ({r[dtypes[0] + '_spread']:.2f}) | "
                     f"{r[low]:.2f} ({r[low + '_spread']:.2f}) | {r['difference']:+.2f} |")
    lines.append("")
    for task, e in errors.items():
        lines.append(f"{task}: {low} vs float32, relative error per layer: " + " / ".join(f"{x:.2e}" for x in e))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from elmo_pipeline.model.hardware import compute_support
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bf16_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--seeds", type=int, default=2, help="probe seeds per setting and dtype (default 2)")
    ap.add_argument("--tasks", default="sst2,nextword")
    ap.add_argument("--sst2", default=os.path.join(SHARED, "data", "sst2"))
    ap.add_argument("--wikitext", default=os.path.join(SHARED, "data", "wikitext-2"))
    ap.add_argument("--device", default="cpu", help="where the vectors are computed (cpu, cuda)")
    ap.add_argument("--work", default=None, help="intermediate outputs (default out/bf16_quality/<device>)")
    ap.add_argument("--limit", type=int, help="at most this many sentences per split (a quick check, not a result)")
    ap.add_argument("--tag", default="", help="results file suffix (e.g. the machine kind)")
    args = ap.parse_args(argv)
    work = args.work or os.path.join(ROOT, "out", "bf16_quality", args.device.replace(":", "_"))
    torch.set_num_threads(1)
    dtypes = ["float32", args.dtype]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    t0 = time.perf_counter()
    results: dict = {"machine": machine(), "device": args.device, "support": compute_support(args.dtype, args.device),
                     "seeds": args.seeds, "threads": 1, "model": "wikitext2-small", "state": "stateless", "tasks": {}}
    if "sst2" in tasks:
        results["tasks"]["sst2"] = sst2(work, dtypes, args.seeds, args.sst2, args.limit, args.device)
    if "nextword" in tasks:
        results["tasks"]["nextword"] = nextword(dtypes, args.seeds, args.wikitext, args.limit, args.device)
    table = [row for task, res in results["tasks"].items() for row in rows(task, res, dtypes)]
    errors = {task: res["dtypes"][args.dtype]["relative_error_per_layer"] for task, res in results["tasks"].items()}
    results.update(table=table, relative_error_per_layer=errors, seconds=round(time.perf_counter() - t0, 1))
    print(f"{machine()}; {args.dtype} on {args.device}: {results['support']['support']}")
    print(markdown(table, errors, dtypes))
    os.makedirs(RESULTS, exist_ok=True)
    name = os.path.join(RESULTS, f"bf16_quality{'_' + args.tag if args.tag else ''}.json")
    with open(name, "w") as f:
        json.dump(results, f, indent=1)
    print(f"-> {os.path.relpath(name, ROOT)} ({results['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
