"""Tokens/s of the whole Beam pipeline (read -> tokenize -> batch -> embed -> Parquet + HDF5 -> manifest)
next to the biLM alone (ElmoEmbedder.embed_sentences) on the same sentences.

    python benchmarks/pipeline_throughput.py [--input valid.txt] [--lines 300] [--size small] [--threads 1]
Uses a random biLM of a published size (model/synthetic.py) unless --options-file/--weight-file.
Prints a table; writes benchmarks/results/pipeline_throughput_<documents>docs.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=os.path.join(HERE, "..", "..", "shared", "data", "wikitext-2", "valid.txt"))
    ap.add_argument("--lines", type=int, default=300, help="first N non-blank lines of the input (default 300)")
    ap.add_argument("--size", default="small", help="synthetic model size (default small: 2x1024 LSTM, 128 proj)")
    ap.add_argument("--options-file")
    ap.add_argument("--weight-file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--max-tokens-per-batch", type=int, default=4096)
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's compute dtype, alone and in the pipeline (--compute-dtype)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/pipeline_throughput_<N>docs.json)")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, os.path.dirname(HERE))        # the repository root, when run as a script
    from benchmarks.common import flops_per_token, gemm_ceiling_gflops, machine, stage_seconds
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.model.synthetic import write_random_bilm
    from elmo_pipeline.pipeline.run import counters, run
    from elmo_pipeline.tokenization import tokenize_document

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="elmo-bench-")
    files = (args.options_file, args.weight_file) if args.options_file else write_random_bilm(args.size, os.path.join(tmp, "m"))
    lines = [x for x in open(args.input, encoding="utf-8").read().split("\n") if x.strip()][: args.lines]
    inp = os.path.join(tmp, "input.txt")
    with open(inp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    sentences = [list(s.tokens) for x in lines for s in tokenize_document(x)]
    n_tokens = sum(map(len, sentences))

    emb = ElmoEmbedder(*files, dtype=args.compute_dtype)
    t_tok = time.perf_counter()
    _ = [tokenize_document(x) for x in lines]
    t_tok = time.perf_counter() - t_tok
    t0 = time.perf_counter()
    for _ in emb.embed_sentences(sentences, max_tokens=args.max_tokens_per_batch):   # the pipeline's batches
        pass
    alone = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = run(["--input", inp, "--output", os.path.join(tmp, "out"), "--options-file", files[0],
                  "--weight-file", files[1], "--torch-threads", str(args.threads), "--progress", "off",
                  "--max-tokens-per-batch", str(args.max_tokens_per_batch), "--compute-dtype", args.compute_dtype])
    wall = time.perf_counter() - t0
    stages = stage_seconds(os.path.join(tmp, "out", "metrics.prom"))
    c = counters(result)
    assert c["tokens"] == n_tokens, (c["tokens"], n_tokens)
    embed_s = c["embed_milliseconds"] / 1000
    pad = 1 - c["batch_tokens"] / c["batch_token_slots"]
    ceiling = gemm_ceiling_gflops(args.threads, dtype=getattr(torch, args.compute_dtype))
    fpt = flops_per_token(emb.model.opts)
    rows = [
        (f"model alone: embed_sentences(max_tokens={args.max_tokens_per_batch})", alone),
        ("pipeline end to end (wall, incl. Beam start-up)", wall),
        ("pipeline: time inside Embed only", embed_s),
        ("tokenizer alone", t_tok),
    ]
    print(f"{len(lines)} documents, {len(sentences)} sentences, {n_tokens} tokens; model {args.size if not args.options_file else files[1]}; "
          f"{args.threads} torch thread(s); pipeline padding {pad:.1%} in {c['batches']} batches")
    print(f"{args.compute_dtype}; GEMM ceiling {ceiling:.0f} GFLOP/s at {args.threads} thread(s) in the same run; "
          "share: tokens/s x FLOPs per token (char CNN counted for every token) / the ceiling")
    print(f"{'what':52s} {'seconds':>8s} {'tokens/s':>9s} {'share':>7s}")
    for name, secs in rows:
        print(f"{name:52s} {secs:8.1f} {n_tokens / secs:9.0f} {n_tokens / secs * fpt / 1e9 / ceiling:7.1%}")
    print("the run's own seconds by stage (its metrics.prom; stages of different bundles overlap): "
          + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    out = args.out or os.path.join(HERE, "results", f"pipeline_throughput_{len(lines)}docs.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": machine() + ", no GPU", "model": args.size, "compute_dtype": args.compute_dtype,
                   "command": " ".join(["python -m benchmarks.pipeline_throughput", *sys.argv[1:]]),
                   "threads": args.threads, "documents": len(lines), "sentences": len(sentences), "tokens": n_tokens,
                   "padding": round(pad, 4), "batches": c["batches"], "gemm_ceiling_gflops": round(ceiling),
                   "flops_per_token": fpt, "stage_seconds": stages,
                   "rows": [{"what": n, "seconds": round(s, 2), "tokens_per_s": round(n_tokens / s),
                             "share_of_ceiling": round(n_tokens / s * fpt / 1e9 / ceiling, 4)} for n, s in rows]},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
