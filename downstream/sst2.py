"""SST-2 ("label<space>sentence" per line) -> JSONL the pipeline and the probe read.

    python -m elmo_pipeline.downstream.sst2 ../shared/data/sst2 data/sst2
writes DIR/{train,dev,test}.jsonl, one {"id": "<split>-<line, 6 digits>", "text": sentence, "label": int}
per line (ids zero-padded so that the pipeline's id order is the file order). Embed each split with
    python -m elmo_pipeline.pipeline.run --input DIR/train.jsonl --input-format jsonl --id-field id --tokenizer whitespace ...
and give the same file to `elmo-pipeline probe --train-labels` (labels are matched by document id).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SPLITS = {"train": "stsa.binary.train", "dev": "stsa.binary.dev", "test": "stsa.binary.test"}


def parse_line(line: str) -> tuple[int, str]:
    """'1 a stirring , funny ...' -> (1, 'a stirring , funny ...')."""
    label, _, text = line.rstrip("\n").rstrip("\r").partition(" ")
    if not label.lstrip("-").isdigit() or not text.strip():
        raise ValueError(f"not 'label sentence': {line[:80]!r}")
    return int(label), text


def convert_file(src: str, dst: str, split: str, limit: int | None = None) -> int:
    n = 0
    with open(src, encoding="utf-8", newline="\n") as f, open(dst, "w", encoding="utf-8") as out:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            label, text = parse_line(line)
            out.write(json.dumps({"id": f"{split}-{i:06d}", "text": text, "label": label}, ensure_ascii=False) + "\n")
            n += 1
            if limit and n >= limit:
                break
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elmo_pipeline.downstream.sst2", description=__doc__.splitlines()[0])
    p.add_argument("source", help="folder with stsa.binary.{train,dev,test}")
    p.add_argument("dest", help="output folder for {train,dev,test}.jsonl")
    p.add_argument("--limit", type=int, help="at most this many sentences per split (quick runs)")
    args = p.parse_args(argv)
    os.makedirs(args.dest, exist_ok=True)
    for split, name in SPLITS.items():
        src = os.path.join(args.source, name)
        if os.path.exists(src):
            n = convert_file(src, os.path.join(args.dest, f"{split}.jsonl"), split, args.limit)
            print(f"{split}: {n} sentences -> {os.path.join(args.dest, split + '.jsonl')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
