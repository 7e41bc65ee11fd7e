"""How far apart the vectors of two kernel paths are (docs/reuse.md#kernel-paths, docs/exactness.md#kernel-path).

`python -m benchmarks.kernel_paths [--sentences 300] [--model NAME] [--out results/kernel_paths_X.json]`: the model
(default: the shipped one) over the first N WikiText-2 sentences, --batch-invariant, 1 torch thread, batches of 32,
in a fresh process per kernel path (the environment set before torch loads): the default path, each LSTM loop
(ELMO_LSTM_GEMM=onednn, =bmm), oneDNN's bf16 math mode (ONEDNN_DEFAULT_FPMATH_MODE=BF16) and an AVX2 cap
(ONEDNN_MAX_CPU_ISA=AVX2). Per path: its kernel_difference from the default path and the largest |difference| of
any vector element from the default path's (float32 vectors, every layer).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.common import machine, wikitext_sentences

PATHS = {"default": {}, "ELMO_LSTM_GEMM=onednn": {"ELMO_LSTM_GEMM": "onednn"},
         "ELMO_LSTM_GEMM=bmm": {"ELMO_LSTM_GEMM": "bmm"},
         "ONEDNN_DEFAULT_FPMATH_MODE=BF16": {"ONEDNN_DEFAULT_FPMATH_MODE": "BF16"},
         "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
CLEARED = ("ELMO_LSTM_GEMM", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "ONEDNN_MAX_CPU_ISA",
           "DNNL_MAX_CPU_ISA")
BATCH = 32


def embed(model: str, n: int, out: str) -> None:
    """In this process: the model's vectors of the first n sentences (every layer, float32) into out (.npy, the
    sentences' (L, T, D) arrays concatenated along T) and this process's kernel path into out + '.json'."""
    import torch

    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.model.kernels import embedder_kernel_path
    torch.set_num_threads(1)
    e = ElmoEmbedder.from_name(model, batch_invariant=True)
    sentences = wikitext_sentences(n)
    vectors = [v for a in range(0, n, BATCH) for v in e.embed_batch(sentences[a: a + BATCH])]
    np.save(out, np.concatenate(vectors, axis=1))
    with open(out + ".json", "w") as f:
        json.dump(embedder_kernel_path(e, "float32"), f)


def measure(model: str, n: int) -> dict:
    """Per kernel path: its difference from the default path (kernel_difference) and the max |diff| of the vectors."""
    from elmo_pipeline.model.kernels import kernel_difference
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in PATHS.items():
            out = os.path.join(tmp, f"{len(got)}.npy")
            clean = {k: v for k, v in os.environ.items() if k not in CLEARED}
            subprocess.run([sys.executable, "-m", "benchmarks.kernel_paths", "--child", out, "--model", model,
                            "--sentences", str(n)], env={**clean, **env}, check=True)
            with open(out + ".json") as f:
                got[name] = (np.load(out), json.load(f))
    base, record = got["default"]
    return {name: {"kernel_difference": kernel_difference(record, r),
                   "max_abs_diff": float(np.abs(v.astype(np.float64) - base).max())}
            for name, (v, r) in got.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--model", default=None, help="a model name (default: the shipped one)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from elmo_pipeline.model.pretrained import DEFAULT_MODEL
    model = a.model or DEFAULT_MODEL
    if a.child:
        embed(model, a.sentences, a.child)
        return {}
    result = {"machine": machine(), "model": model, "sentences": a.sentences, "paths": measure(model, a.sentences)}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
