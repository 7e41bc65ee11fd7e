"""A worker's host cost per token: everything but the biLM's arithmetic, measured stage by stage, and the
pipeline's end-to-end tokens/s, side by side with another revision (the issue's starting commit).

    python -m benchmarks.host_cost [--lines 1500] [--baseline REV] [--runs 2] [--quick]

The model is near-free but as wide as the original: random weights, a tiny char CNN, LSTM dim 16,
projection 512 (every layer 1,024 wide), so every cost but the model's arithmetic is the original's.
Input: WikiText-2 valid.txt's first --lines lines, raw tokenizer, 1 torch thread, Parquet only unless
named. Stages (CPU microseconds per token, one thread, the functions the pipeline runs):
  read, tokenize (raw; its floor: blingfire + sacremoses alone; whitespace), char ids, batching, model,
  layer selection and copies, Parquet encode (table build + pyarrow's encoder; the encoder alone is the
  floor), HDF5 encode, file write; and the model's floor: its LSTM FLOPs per token at the 1-thread GEMM
  ceiling measured in the same run. Beam and hand-off overhead = the default run's CPU per token after
  start-up minus its stages. Bound = cores / (the two floors + the model's floor): the tokens/s that no
  change to the host path can beat on this machine.
End to end (a `python -m elmo_pipeline.pipeline.run` process each; start-up = the same command on the first 8 non-blank
  lines, subtracted with their tokens, so that every worker's model loading is start-up):
  wall tokens/s, CPU per token, CPU/wall while embedding, for: default output (also tokenizing inline, with
  one or two batches in the biLM at a time), --duplicate-layer0, --layers 2, whitespace --layers 2 (also one batch at a
  time), Parquet + HDF5, and 2 local workers.
Prints tables; writes benchmarks/results/host_cost.json naming the CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WIDE_CHEAP = {"lstm": {"cell_clip": 3, "proj_clip": 3, "n_layers": 2, "use_skip_connections": True, "dim": 16,
                       "projection_dim": 512},
              "char_cnn": {"activation": "relu", "embedding": {"dim": 4}, "filters": [[1, 8], [2, 8], [3, 16]],
                           "max_characters_per_token": 50, "n_characters": 262, "n_highway": 1}}
TWO = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
INLINE = ["--tokenizer-process", "off"]
ONE_BATCH = ["--embed-threads", "1"]
TWO_BATCHES = ["--embed-threads", "2"]
NEW_FLAGS = (INLINE[0], ONE_BATCH[0])        # flags the baseline does not have: rows with them, this tree only
CONFIGS = {   # name -> (extra flags, tokenizer input: raw text or pre-tokenized lines)
    "default (3 layers, fp32), Parquet": ([], "raw"),
    "default, tokenizing inline (--tokenizer-process off)": (INLINE, "raw"),
    "default, tokenizing inline, one batch at a time (--embed-threads 1)": (INLINE + ONE_BATCH, "raw"),
    "default, two batches at a time (--embed-threads 2)": (TWO_BATCHES, "raw"),
    "--duplicate-layer0": (["--duplicate-layer0"], "raw"),
    "--layers 2": (["--layers", "2"], "raw"),
    "--dtype float16": (["--dtype", "float16"], "raw"),
    "whitespace, --layers 2": (["--layers", "2", "--tokenizer", "whitespace", "--input-format", "lines"], "ws"),
    "whitespace, --layers 2, one batch at a time (--embed-threads 1)":
        (["--layers", "2", "--tokenizer", "whitespace", "--input-format", "lines", *ONE_BATCH], "ws"),
    "Parquet + HDF5": (["--format", "parquet,hdf5"], "raw"),
    "2 workers (multi_processing)": (TWO, "raw"),
    "2 workers, tokenizing inline": (TWO + INLINE, "raw"),
}
STARTUP_LINES = 8
DIGEST = "file records: SHA-256 of the Parquet and HDF5 bytes (taken as they are written: manifest.json 'files')"
MODEL_FLOOR = "model floor: its LSTM GEMMs' FLOPs at the 1-thread GEMM ceiling measured here"
DIRECT = ("Parquet encode + write straight into a local file, then its pages released (what the pipeline does; vs "
          "encode + file write above)")
DEFAULT_PATH = ("read", "tokenize raw", "batching", "char ids", "model (near-free biLM)",
                "layer selection and copies (Parquet)", "Parquet table build", DIRECT)   # the default run's stages
QUICK = ("default (3 layers, fp32), Parquet", "Parquet + HDF5")


def cpu() -> float:
    return time.process_time()


def stage_costs(text_path: str, model: tuple[str, str], budget: int) -> dict:
    """CPU microseconds per token of each stage, run as plain functions in this process (1 thread)."""
    import fsspec
    import numpy as np
    import torch

    from elmo_pipeline.formats.hdf5 import hdf5_bytes
    from elmo_pipeline.formats.parquet import build_table, layer_columns, parquet_bytes, write_parquet
    from elmo_pipeline.fsio import release_written
    from elmo_pipeline.model.batching import plan_batches
    from elmo_pipeline.model.char_ids import distinct_char_ids
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.transforms.read import read_documents
    from elmo_pipeline.transforms.records import Document, EmbeddedBatch, Item
    from elmo_pipeline.tokenization.tokenizers import _sentence_spans, moses_tokens, tokenize_document
    from elmo_pipeline.transforms.embed import reuse_freed_memory
    from elmo_pipeline.output.staging import ShardSpec, hdf5_sentences, shard_columns
    torch.set_num_threads(1)
    reuse_freed_memory()                     # as the pipeline's workers do
    t = {}
    c = cpu()
    docs = [d for d in read_documents(text_path, "text", "valid") if isinstance(d, Document)]
    t["read"] = cpu() - c
    tokenize_document(docs[0].text, "raw")              # one-time set-up (Moses' regexes), as start-up
    c = cpu()
    sents = [(d, i, s) for d in docs for i, s in enumerate(tokenize_document(d.text, "raw"))]
    t["tokenize raw"] = cpu() - c
    n = sum(len(s.tokens) for *_, s in sents)
    c = cpu()
    for d in docs:
        for a, b in _sentence_spans(d.text):
            moses_tokens(d.text[a:b])
    t["tokenize raw floor: blingfire + sacremoses alone"] = cpu() - c
    lines = [" ".join(s.tokens) for *_, s in sents]
    c = cpu()
    for line in lines:
        tokenize_document(line, "whitespace", split_sentences=False)
    t["tokenize whitespace"] = cpu() - c
    c = cpu()
    items = [Item(f"{d.doc_id}#{i}", d.doc_id, i, s.tokens, s.offsets) for d, i, s in sents]
    batches = [[items[i] for i in idx] for idx in plan_batches([len(x.tokens) for x in items], budget)]
    t["batching"] = cpu() - c
    e = ElmoEmbedder(*model, token_cache=50_000)
    max_chars = e.model.opts.max_characters_per_token
    c = cpu()
    inputs = [distinct_char_ids([x.tokens for x in b], max_chars) for b in batches]
    t["char ids"] = cpu() - c
    with torch.inference_mode():   # warm the token cache as a long run would have it
        for u, idx, lengths in inputs:
            e.model.forward_tokens(torch.from_numpy(u), torch.from_numpy(idx), torch.from_numpy(lengths))
        c = cpu()           # each batch's output dropped at once, so its memory is reused as in a worker
        for u, idx, lengths in inputs:
            e.model.forward_tokens(torch.from_numpy(u), torch.from_numpy(idx), torch.from_numpy(lengths))
        t["model (near-free biLM)"] = cpu() - c
        outs = [e.model.forward_tokens(torch.from_numpy(u), torch.from_numpy(idx), torch.from_numpy(lengths))[0].numpy()
                for u, idx, lengths in inputs]       # kept for the stages below (untimed)
    from benchmarks.common import gemm_ceiling_gflops, lstm_flops_per_token
    ceiling = gemm_ceiling_gflops(1)
    t[MODEL_FLOOR] = lstm_flops_per_token(e.model.opts) * n / (ceiling * 1e9)
    embedded = []
    for b, o in zip(batches, outs):
        off = np.zeros(len(b) + 1, dtype=np.int64)
        np.cumsum([len(x.tokens) for x in b], out=off[1:])
        embedded.append(EmbeddedBatch(b, o, off))
    sel = (0, 1, 2)
    spec = ShardSpec(("parquet", "hdf5"), "sentence", tuple(layer_columns(list(sel), 1024, False)), sel, False,
                     "float32", 64 << 20, 3, 1024)
    shards, shard, size = [], [], 0          # as WriteShards cuts them: --shard-bytes 64 MiB
    for eb in embedded:
        for i in range(len(eb.items)):
            shard.append((eb, i))
            size += eb.tokens(i) * spec.bytes_per_token
            if size >= 64 << 20:
                shards.append(shard)
                shard, size = [], 0
    shards.append(shard)
    build_table(shard_columns(shards[0][:1], spec), "sentence", list(spec.columns))     # pyarrow's one-time set-up
    shards = [sorted(sh, key=lambda p: p[0].items[p[1]].id) for sh in shards]
    zstd = "Parquet encode, --vector-compression zstd (not in the pipeline's default)"
    direct = DIRECT
    for name in ("layer selection and copies (Parquet)", "Parquet table build", "Parquet encode floor: pyarrow's encoder",
                 zstd, "layer selection and copies (HDF5)", "HDF5 encode", "file write (Parquet bytes)", direct, DIGEST):
        t[name] = 0.0
    size = size_zstd = 0
    with tempfile.TemporaryDirectory() as tmp:
        for sh in shards:
            c = cpu()
            cols = shard_columns(sh, spec)
            t["layer selection and copies (Parquet)"] += cpu() - c
            c = cpu()
            table = build_table(cols, "sentence", list(spec.columns))
            t["Parquet table build"] += cpu() - c
            c = cpu()
            data = parquet_bytes(table, spec.row_group_bytes, spec.vector_compression)
            t["Parquet encode floor: pyarrow's encoder"] += cpu() - c
            c = cpu()
            size_zstd += len(parquet_bytes(table, spec.row_group_bytes, "zstd"))
            t[zstd] += cpu() - c
            c = cpu()
            h5 = list(hdf5_sentences(sh, spec))
            t["layer selection and copies (HDF5)"] += cpu() - c
            c = cpu()
            h5_data = hdf5_bytes(h5)
            t["HDF5 encode"] += cpu() - c
            c = cpu()       # the manifest's file records: every byte of both formats hashed as it is written
            hashlib.sha256(data).hexdigest(), hashlib.sha256(h5_data).hexdigest()
            t[DIGEST] += cpu() - c
            c = cpu()       # a new file per shard, kept, as in a run (rewriting one file reuses its pages)
            with open(os.path.join(tmp, f"x{size}.parquet"), "wb") as f:
                f.write(data)
            t["file write (Parquet bytes)"] += cpu() - c
            c = cpu()
            path = os.path.join(tmp, f"y{size}.parquet")
            write_parquet(table, path, spec.row_group_bytes, spec.vector_compression)
            release_written(fsspec.filesystem("file"), path)
            t[direct] += cpu() - c
            size += len(data)
            del cols, table, data, h5, h5_data
    return {"tokens": n, "sentences": len(items), "gemm_ceiling_gflops_1_thread": ceiling, "parquet_bytes_per_token": size / n, "parquet_zstd_bytes_per_token": size_zstd / n, "shards": len(shards),
            "us_per_token": {k: 1e6 * v / n for k, v in t.items()}}


def run_pipeline(tree: str, input_path: str, out: str, model: tuple[str, str], flags: list[str]) -> dict:
    """One `python -m elmo_pipeline.pipeline.run` process from `tree`: wall seconds, CPU seconds (user+sys), its summary."""
    cmd = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", input_path, "--output", out, "--overwrite",
           "--options-file", model[0], "--weight-file", model[1], "--torch-threads", "1", "--progress", "off",
           "--format", "parquet", *flags]
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu_s, "summary": p.stderr.strip().splitlines()[-1]}


def end_to_end(trees: dict[str, str], inputs: dict[str, tuple[str, str, int, int]], model, configs, runs: int) -> dict:
    """Per config and tree: best-of-`runs` wall and CPU after start-up, tokens/s, CPU us/token, CPU/wall.
    Start-up: the same command on the input's first STARTUP_LINES lines (enough for every worker to load the
    model), whose tokens are subtracted too."""
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            flags, kind = CONFIGS[name]
            path, head, n_all, n_head = inputs[kind]
            n = n_all - n_head
            for label, tree in trees.items():
                if label != "this tree" and any(f in flags for f in NEW_FLAGS):
                    continue
                start = min((run_pipeline(tree, head, os.path.join(tmp, "s"), model, flags) for _ in range(runs)),
                            key=lambda r: r["wall"])
                best = min((run_pipeline(tree, path, os.path.join(tmp, "o"), model, flags) for _ in range(runs)),
                           key=lambda r: r["wall"])
                wall, cpu_s = best["wall"] - start["wall"], best["cpu"] - start["cpu"]
                res.setdefault(name, {})[label] = {
                    "tokens": n, "wall_s": round(best["wall"], 3), "startup_wall_s": round(start["wall"], 3),
                    "tokens_per_s": n / wall, "cpu_us_per_token": 1e6 * cpu_s / n, "cpu_over_wall": cpu_s / wall,
                    "summary": best["summary"]}
                print(f"  {name:34s} {label:10s} {n / wall:9.0f} tok/s  {1e6 * cpu_s / n:6.1f} us CPU/token  "
                      f"CPU/wall {cpu_s / wall:4.2f}", flush=True)
    return res


def markdown(stages: dict, e2e: dict, baseline: str) -> str:
    """The two tables of benchmarks/README.md, as printed."""
    rows = ["| stage | CPU us per token |", "| --- | --- |"]
    rows += [f"| {k} | {v:.2f} |" for k, v in stages["us_per_token"].items()]
    rows += ["", "| output (end to end, after start-up) | tokens/s | CPU us per token | CPU/wall |"
             + (f" tokens/s at {baseline} | CPU us per token at {baseline} | ratio |" if baseline else ""),
             "| --- | --- | --- | --- |" + (" --- | --- | --- |" if baseline else "")]
    for name, by_tree in e2e.items():
        r = by_tree["this tree"]
        row = f"| {name} | {r['tokens_per_s']:,.0f} | {r['cpu_us_per_token']:.1f} | {r['cpu_over_wall']:.2f} |"
        if baseline and baseline in by_tree:
            b = by_tree[baseline]
            row += f" {b['tokens_per_s']:,.0f} | {b['cpu_us_per_token']:.1f} | {r['tokens_per_s'] / b['tokens_per_s']:.2f}x |"
        elif baseline:
            row += " (no such flag) | | |"
        rows.append(row)
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=os.path.join(REPO, "..", "shared", "data", "wikitext-2", "valid.txt"))
    ap.add_argument("--lines", type=int, default=1500, help="the input's first N lines (default 1500)")
    ap.add_argument("--baseline", default="ae7e33c", help="revision to compare with, side by side (default: "
                    "the host-cost issue's starting commit); '' for none")
    ap.add_argument("--runs", type=int, default=2, help="end-to-end runs per config, best kept (default 2)")
    ap.add_argument("--max-tokens-per-batch", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--only", nargs="+", default=None, help="only the end-to-end configs whose names contain one of these")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "host_cost.json"))
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    from benchmarks.common import machine, trees
    from elmo_pipeline.model.synthetic import write_random_bilm
    from elmo_pipeline.tokenization import tokenize_document

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_bilm(WIDE_CHEAP, os.path.join(tmp, "model"))
        with open(args.input, encoding="utf-8", newline="\n") as f:
            lines = [next(f, "") for _ in range(args.lines)]
        raw = os.path.join(tmp, "raw.txt")
        with open(raw, "w", encoding="utf-8") as f:
            f.writelines(lines)
        sentences = [" ".join(s.tokens) for ln in lines for s in tokenize_document(ln, "raw")]
        ws = os.path.join(tmp, "ws.txt")
        with open(ws, "w", encoding="utf-8") as f:
            f.write("\n".join(sentences) + "\n")
        n = sum(len(s.split()) for s in sentences)
        first_raw, first_ws = os.path.join(tmp, "raw_head.txt"), os.path.join(tmp, "ws_head.txt")
        head_lines = [ln for ln in lines if ln.strip()][:STARTUP_LINES]
        with open(first_raw, "w", encoding="utf-8") as f:
            f.writelines(head_lines)
        with open(first_ws, "w", encoding="utf-8") as f:
            f.write("\n".join(sentences[:STARTUP_LINES]) + "\n")
        n_raw_head = sum(len(s.tokens) for ln in head_lines for s in tokenize_document(ln, "raw"))
        n_ws_head = sum(len(s.split()) for s in sentences[:STARTUP_LINES])
        print(f"{machine()}; {args.lines} lines, {n} tokens, near-free wide model (every layer 1,024 wide)")
        print("Stages (CPU us per token, this tree, 1 thread):", flush=True)
        stages = stage_costs(raw, model, args.max_tokens_per_batch)
        for k, v in stages["us_per_token"].items():
            print(f"  {k:50s} {v:7.2f}")
        with trees(args.baseline, tmp) as sides:
            print("End to end (after start-up):", flush=True)
            configs = QUICK if args.quick else tuple(CONFIGS)
            if args.only:
                configs = tuple(c for c in configs if any(w in c for w in args.only))
            e2e = end_to_end(sides, {"raw": (raw, first_raw, n, n_raw_head), "ws": (ws, first_ws, n, n_ws_head)},
                             model, configs, args.runs)
    us = stages["us_per_token"]
    floors = us["tokenize raw floor: blingfire + sacremoses alone"] + us["Parquet encode floor: pyarrow's encoder"]
    # What no change to the host path can beat on this machine: the two floors plus the model's own arithmetic,
    # spread perfectly over every core.
    with_model = floors + us[MODEL_FLOOR]
    summary = {"sum_of_floors_us": floors, "sum_of_floors_with_model_floor_us": with_model,
               "bound_tokens_per_s": os.cpu_count() * 1e6 / with_model}
    default = e2e.get("default (3 layers, fp32), Parquet", {}).get("this tree")
    if default:
        cpu_us = default["cpu_us_per_token"]
        summary.update(cpu_us_per_token_default=cpu_us, cpu_over_floors=cpu_us / floors,
                       cpu_over_floors_with_model_floor=cpu_us / with_model,
                       host_cpu_over_floors=(cpu_us - us["model (near-free biLM)"]) / floors,
                       beam_and_handoff_us=cpu_us - sum(us[k] for k in DEFAULT_PATH))
        if args.baseline:
            base = e2e["default (3 layers, fp32), Parquet"][args.baseline]["tokens_per_s"]
            summary["speedup_default"] = default["tokens_per_s"] / base
            summary["bound_over_baseline"] = summary["bound_tokens_per_s"] / base
        if "Parquet + HDF5" in e2e:
            both = e2e["Parquet + HDF5"]["this tree"]
            summary["parquet_hdf5_over_parquet_cpu"] = both["cpu_us_per_token"] / default["cpu_us_per_token"]
    print("Summary:", json.dumps({k: round(v, 3) for k, v in summary.items()}))
    print(markdown(stages, e2e, args.baseline))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "lines": args.lines, "model": WIDE_CHEAP, "stages": stages,
                   "end_to_end": e2e, "summary": summary, "baseline": args.baseline}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
