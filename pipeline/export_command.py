"""`elmo-pipeline export CHECKPOINT FOLDER`: options.json + weights.hdf5 (bilm-tf layout) + vocab.txt.

weights.hdf5 also holds the LM softmax as 'softmax/...' datasets (ignored by inference loaders) unless
--no-softmax; evaluate and --init-from use them.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from elmo_pipeline.pipeline.validate import local_path
    p.add_argument("checkpoint", help="a training checkpoint (RUN/checkpoints/ckpt-*.h5), or a run folder (its latest)")
    p.add_argument("folder", type=local_path("folder"), help="output folder, a local path")
    p.add_argument("--no-softmax", action="store_true", help="inference weights only")


def run(args: argparse.Namespace) -> int:
    import os

    from elmo_pipeline.training.export import export_model, head_from_checkpoint
    from elmo_pipeline.training.train import latest_checkpoint

    ckpt = args.checkpoint
    if os.path.isdir(ckpt):
        ckpt = latest_checkpoint(ckpt)
        if ckpt is None:
            raise SystemExit(f"error: no checkpoint in {args.checkpoint}/checkpoints")
    head, vocab, meta = head_from_checkpoint(ckpt)
    paths = export_model(head, vocab, args.folder, include_softmax=not args.no_softmax)
    print(f"exported {ckpt} (step {meta['step']}) to {', '.join(paths)}", file=sys.stderr)
    return 0
