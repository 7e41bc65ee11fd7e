"""Does the probe's linear tagger reach a converged logistic regression on the same vectors?

A 15-class token task built from WikiText-2 (../shared/data/wikitext-2): each token is tagged with the word class
of the NEXT token (punctuation, number, capitalized, determiner, preposition, pronoun, conjunction, auxiliary,
<unk>, -ly/-ing/-ed/-s, other, or END), so contextual layers matter. Train: the first 2,500 sentences of
valid.txt; dev: test.txt sentences 1-600; test: 601-1,800 (sentences cut at "."). Vectors: the shipped model,
stateless. Per layer, test accuracy of
  probe        downstream.probe.train_setting with its defaults (L-BFGS for a linear head, best dev check kept)
  adam-old     the earlier default for the tagger: Adam lr 1e-3, batch 32, dropout 0.3, 20 epochs, best dev epoch
  regression   a multinomial logistic regression on the same standardized layer, float64 L-BFGS to convergence,
               no penalty
    python benchmarks/probe_linear_fit.py [--wikitext DIR] [--threads 1]
Prints a table; writes benchmarks/results/probe_linear_fit.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CLOSED = {"DET": {"the", "a", "an", "this", "that", "these", "those"},
          "PREP": {"of", "in", "to", "for", "on", "with", "by", "at", "from", "as", "into", "after", "during", "between"},
          "PRON": {"he", "she", "it", "they", "his", "her", "its", "their", "i", "we", "you", "him", "them", "which", "who"},
          "CONJ": {"and", "or", "but"},
          "AUX": {"is", "was", "are", "were", "be", "been", "has", "have", "had", "will", "would", "can", "could"}}


def word_class(token: str | None) -> str:
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


def main() -> int:
    from downstream.probe import ProbeConfig, Split, logistic_regression_accuracy, train_setting
    from model.embedder import ElmoEmbedder
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wikitext", default=os.path.join(HERE, "..", "..", "shared", "data", "wikitext-2"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    emb = ElmoEmbedder()
    parts, classes = next_word_task(args.wikitext)
    splits = {name: Split(name, embed_task(emb, recs)).prepare("token") for name, recs in parts.items()}
    train, dev, tst = splits["train"], splits["dev"], splits["test"]
    stats = train.token_stats()
    rows = []
    for layer in range(emb.n_layers):
        row = {"layer": layer}
        for name, extra in (("probe", {}), ("adam-old", {"optimizer": "adam", "dropout": 0.3, "lr": 1e-3, "epochs": 20})):
            t0 = time.perf_counter()
            r = train_setting(f"layer{layer}", ProbeConfig(task="token", classes=list(range(len(classes))), stats=stats,
                                                           **extra), train, dev, tst, emb.n_layers, emb.output_dim)
            row[name], row[f"{name}_seconds"] = r["test"]["accuracy"], round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        row["regression"] = logistic_regression_accuracy(train, tst, layer, stats)
        row["regression_seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"layer{layer}: probe {100 * row['probe']:.1f}  adam-old {100 * row['adam-old']:.1f}  "
              f"regression {100 * row['regression']:.1f}", flush=True)
    result = {"classes": classes, "tokens": {k: int(len(s.targets)) for k, s in splits.items()}, "rows": rows,
              "threads": args.threads, "machine": platform.machine(), "torch": torch.__version__}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "probe_linear_fit.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
