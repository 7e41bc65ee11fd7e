"""`elmo-pipeline models`: the models known by name (model/pretrained), their sizes, dims and cache state.

    elmo-pipeline models              # table
    elmo-pipeline models --json       # one JSON object per model
    elmo-pipeline models --download small   # fetch (and record sha256/size of) a published model now
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--download", metavar="NAME", action="append", default=[],
                   help="download (or verify the cached copy of) this model first (repeatable)")


def table(rows: list[dict]) -> str:
    head = ("name", "layers", "dim", "lstm", "parameters", "tokenization", "weights", "state")
    cells = [head] + [(r["name"], str(r["layers"]), str(r["dim"]), str(r["lstm_dim"]), f"{r['parameters'] / 1e6:.1f}M",
                       r["tokenization"], f"{r['weights_bytes'] / 2**20:.1f} MiB" if r["weights_bytes"] else "-",
                       r["state"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def run(args: argparse.Namespace) -> int:
    from elmo_pipeline.fsio import redact
    from elmo_pipeline.model.pretrained import MODELS, base_url, cache_folder, describe, model_files
    try:
        for name in args.download:
            model_files(name, progress=True)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    rows = [describe(name) for name in MODELS]
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        print(table(rows))
        print(f"\npublished models: {redact(base_url())} -> {cache_folder('NAME')} (first use downloads them)")
    return 0
