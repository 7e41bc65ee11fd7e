"""Launch budget: aten ops dispatched per batch and per token on a fake CUDA device (benchmarks/opcount.py: no
GPU, no FLOPs, the op sequence a GPU would run), per path and token budget, for a published shape; and a
projected time per batch on an H100: launches x LAUNCH_US + FLOPs / (share x peak).

    python -m benchmarks.launches [--config original] [--budgets 4096 16384 65536] [--tag before]

Each batch is the first plan_batches() batch of WikiText-2 validation sentences at that budget (benchmarks/
common.py), counted from the host data handed to the model to the results back on the host, after one
warm-up batch (weights stacked, token cache filled with that batch's tokens). Paths: forward (BiLM.forward,
fast), forward_invariant (batch_invariant=True), embedder (ElmoEmbedder.embed_batch: char ids, token cache,
numpy out; its sentences in lanes, the batch cut by token slots), embedder_no_lanes (the same without lanes, the
padded-slot batch), stateful (the embedder in stateful mode), windows (one sentence of `budget` tokens in windows of
512, overlap 128, model/windows.py), training (the padded forward under autograd, no backward).
Launches by region: encoder (token encoder), lstm (model.lstm.run_lstm_layers), other.
Prints a table and writes benchmarks/results/launches_<tag>.json naming the machine. Works on any tree with
model.device.host_side (host work then runs for real, uncounted).
"""
from __future__ import annotations

import argparse
import json
import os
from unittest import mock

import torch

from benchmarks.common import RESULTS, flops_per_token, machine, wikitext_sentences
from benchmarks.opcount import OpCounter, fake_cuda, fake_model
from model.batching import plan_batches
from model.char_ids import batch_char_ids

LAUNCH_US = 5.0                                   # host cost of one kernel launch, stated, not measured
PEAK_TFLOPS = {"fp32": 67.0, "bf16": 990.0}       # H100 SXM dense: fp32 non-tensor (TF32 off), bf16 tensor
SHARE = 0.5                                       # achievable share of the peak for the GEMMs, assumed
PATHS = ("forward", "forward_invariant", "embedder", "embedder_no_lanes", "stateful", "windows", "training")
LANES = ("embedder", "windows")          # paths whose batches the model lays in lanes (token-slot budgets)


def _embedder(model, **kw):
    from model.embedder import ElmoEmbedder
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=1):
        return ElmoEmbedder(model=model, device=model.w_device, **kw)


def count_path(path: str, config: str, batch: list[list[str]], warm: list[list[str]], ids, lengths) -> dict:
    """One batch of `path` counted on a fake CUDA device: OpCounter.report() plus tokens."""
    with fake_cuda() as dev:
        model = fake_model(config, dev)
        if path in ("embedder", "embedder_no_lanes", "stateful", "windows"):
            e = _embedder(model, state="stateful" if path == "stateful" else "stateless",
                          **({"lanes": False} if path == "embedder_no_lanes" else {}))
            e.embed_batch(warm)
            with OpCounter(model) as n:
                if path == "windows":
                    from model.windows import embed_long
                    embed_long(e, [t for s in batch for t in s],
                               window=512, overlap=128, max_tokens=4096)
                else:
                    e.embed_batch(batch)
        elif path == "training":
            model.requires_grad_(False)              # see tests/test_fake_cuda.py: no backward on fake CUDA
            x = ids.to(dev)
            with OpCounter(model) as n:
                model(x, lengths)[0].sum()
        else:
            inv = path == "forward_invariant"
            with torch.inference_mode():
                model(ids.to(dev), lengths, batch_invariant=inv)
                with OpCounter(model) as n:
                    x = ids.to(dev)
                    model(x, lengths, batch_invariant=inv)[0].cpu()
    return {**n.report(), "tokens": sum(map(len, batch)), "sentences": len(batch)}


def project(row: dict, fpt: int) -> dict:
    """H100 time per batch: launch time and GEMM time at SHARE of each dtype's dense peak."""
    launch_s = row["launches"] * LAUNCH_US * 1e-6
    out = {"launch_ms": 1e3 * launch_s}
    for dt, peak in PEAK_TFLOPS.items():
        math_s = row["tokens"] * fpt / (SHARE * peak * 1e12)
        total = launch_s + math_s
        out[f"{dt}_math_ms"] = 1e3 * math_s
        out[f"{dt}_batch_ms"] = 1e3 * total
        out[f"{dt}_launch_share"] = launch_s / total
        out[f"{dt}_tokens_per_s"] = row["tokens"] / total
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="original")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--sentences", type=int, default=6000)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    sentences = wikitext_sentences(args.sentences)
    warm = wikitext_sentences(200, split="train")[100:164]
    from model.options import parse_options
    from model.synthetic import PUBLISHED_OPTIONS
    fpt = flops_per_token(parse_options(PUBLISHED_OPTIONS[args.config]))
    rows = []
    print(f"{'path':<18} {'budget':>6} {'tokens':>6} {'launches':>8} {'/token':>7} {'lstm':>6} {'encoder':>7} "
          f"{'other':>6} {'h2d':>3} {'d2h':>3} {'launch ms':>9} {'fp32 ms':>8} {'share':>6} {'bf16 ms':>8} "
          f"{'share':>6} {'bf16 tok/s':>10}")
    for budget in args.budgets:
        for path in args.paths:
            idx = plan_batches([len(s) for s in sentences], budget, lanes=path in LANES)[0]
            batch = [sentences[i] for i in idx]
            ids, lengths = (torch.from_numpy(a) for a in batch_char_ids(batch))
            r = count_path(path, args.config, batch, warm, ids, lengths)
            r.update(path=path, budget=budget, config=args.config, launches_per_token=r["launches"] / r["tokens"])
            r.update(project(r, fpt))
            rows.append(r)
            g = r["by_region"]
            print(f"{path:<18} {budget:>6} {r['tokens']:>6} {r['launches']:>8} {r['launches_per_token']:>7.3f} "
                  f"{g.get('lstm', 0):>6} {g.get('encoder', 0):>7} {g.get('other', 0):>6} {r['h2d_copies']:>3} "
                  f"{r['d2h_copies']:>3} {r['launch_ms']:>9.2f} {r['fp32_batch_ms']:>8.2f} "
                  f"{100 * r['fp32_launch_share']:>5.1f}% {r['bf16_batch_ms']:>8.2f} "
                  f"{100 * r['bf16_launch_share']:>5.1f}% {r['bf16_tokens_per_s']:>10.0f}", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = "launches" + (f"_{args.tag}" if args.tag else "") + ".json"
    with open(os.path.join(RESULTS, name), "w") as f:
        json.dump({"machine": machine(), "torch": torch.__version__, "config": args.config,
                   "flops_per_token": fpt, "assumptions": {"launch_us": LAUNCH_US, "peak_tflops": PEAK_TFLOPS,
                                                           "share_of_peak": SHARE},
                   "rows": rows}, f, indent=2)
    print(f"launch cost {LAUNCH_US} us; H100 SXM dense peaks {PEAK_TFLOPS} TFLOP/s at {SHARE:.0%}; "
          f"{fpt / 1e6:.0f} MFLOP/token; wrote {name}")


if __name__ == "__main__":
    main()
