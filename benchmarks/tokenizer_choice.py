"""Which raw-text tokenizer: agreement with WikiText's Moses-style tokens, and speed.

WikiText-2 paragraphs are Moses-tokenized (aggressive hyphen splits as @-@). We rebuild raw text
from them (@x@ joined, then sacremoses' Moses detokenizer; this favours Moses-like tokenizers, which
is the point: ELMo was trained on such tokens; <unk> becomes UNK), re-tokenize, and compare token sequences (matched
tokens by difflib, F1) and exact paragraph matches. Tokens are compared with @-@/@,@/@.@ -> -/,/.

    python benchmarks/tokenizer_choice.py [PATH_TO_valid.txt] [--limit N]
Prints a table; writes benchmarks/results/tokenizer_choice.json.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import platform
import re
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AT = re.compile(r" @([-,.])@ ")


def paragraphs(path: str, limit: int) -> list[list[str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("= "):
                continue
            out.append(["UNK" if t == "<unk>" else t for t in line.split()])
            if len(out) >= limit:
                break
    return out


def norm(tokens: list[str]) -> list[str]:
    return [{"@-@": "-", "@,@": ",", "@.@": "."}.get(t, t) for t in tokens]


def candidates():
    import blingfire
    import sacremoses
    import syntok.segmenter as seg

    from tokenization import tokenize_document

    mt = sacremoses.MosesTokenizer("en")

    def bling(text):
        return blingfire.text_to_words(text).split()

    def syn(text):
        return [t.value for p in seg.analyze(text) for s in p for t in s]

    def sacre_only(text):
        return mt.tokenize(text, escape=False, aggressive_dash_splits=True)

    def ours(text):
        return [t for s in tokenize_document(text) for t in s.tokens]

    return {"blingfire 0.1.8 (words+sentences)": bling, "syntok 1.4.4": syn,
            "sacremoses 0.2.0 (words only)": sacre_only, "ours: blingfire sentences + sacremoses words + offsets": ours}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=os.path.join(HERE, "..", "..", "shared", "data", "wikitext-2", "valid.txt"))
    ap.add_argument("--limit", type=int, default=1000, help="paragraphs (default 1000)")
    args = ap.parse_args()
    import sacremoses
    detok = sacremoses.MosesDetokenizer("en")
    gold = paragraphs(args.path, args.limit)
    raw = [detok.detokenize(AT.sub(lambda m: m.group(1), " ".join(p)).split()) for p in gold]
    n_gold = sum(len(p) for p in gold)
    rows = []
    for name, fn in candidates().items():
        t0 = time.perf_counter()
        preds = [fn(r) for r in raw]
        secs = time.perf_counter() - t0
        matched = n_pred = exact = 0
        for g, p in zip(gold, preds):
            g, p = norm(g), norm(p)
            n_pred += len(p)
            matched += sum(b.size for b in difflib.SequenceMatcher(None, g, p, autojunk=False).get_matching_blocks())
            exact += g == p
        prec, rec = matched / max(n_pred, 1), matched / n_gold
        rows.append({"tokenizer": name, "token_f1": round(2 * prec * rec / (prec + rec), 4),
                     "exact_paragraphs": round(exact / len(gold), 4), "tokens_per_s": round(n_pred / secs)})
    print(f"{len(gold)} WikiText-2 paragraphs, {n_gold} gold tokens")
    print(f"{'tokenizer':58s} {'token F1':>9s} {'exact':>7s} {'tokens/s':>10s}")
    for r in rows:
        print(f"{r['tokenizer']:58s} {r['token_f1']:9.4f} {r['exact_paragraphs']:7.3f} {r['tokens_per_s']:10d}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "tokenizer_choice.json"), "w") as f:
        json.dump({"machine": f"{platform.machine()} {os.cpu_count()} cores", "paragraphs": len(gold),
                   "gold_tokens": n_gold, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
