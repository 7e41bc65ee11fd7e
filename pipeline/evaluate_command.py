"""`elmo-pipeline evaluate`: forward, backward and mean perplexity of a biLM on held-out text.

The model is an exported folder (options.json, weights.hdf5 with its softmax datasets, vocab.txt) or a
training checkpoint. Text is windowed as in training (training/data.py), LSTM state zero per window.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from elmo_pipeline.pipeline.validate import at_least, local_path
    p.add_argument("files", nargs="+", help="held-out text: paths, fsspec URLs or globs")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="exported folder (default: the shipped model)")
    what.add_argument("--checkpoint", help="a training checkpoint (.h5)")
    p.add_argument("--tokenizer", choices=("whitespace", "raw"), default="whitespace")
    p.add_argument("--batch-size", type=at_least(1), default=64)
    p.add_argument("--threads", type=at_least(1), help="torch CPU threads")
    p.add_argument("--unigram-baseline", help="also report the add-one unigram perplexity estimated on this training text")
    p.add_argument("--json", type=local_path("file"), help="also write the result as JSON to this local file")


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from elmo_pipeline.training.export import head_from_checkpoint, load_exported
    from elmo_pipeline.training.head import evaluate
    from elmo_pipeline.training.train import load_corpus_for

    if args.json:
        from elmo_pipeline.fsio import only_a_file
        only_a_file(args.json)          # before the work: a link, a folder or a FIFO there is refused, left as it is
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.checkpoint:
        head, vocab, meta = head_from_checkpoint(args.checkpoint)
        options = meta["options"]
    else:
        folder = args.model
        if folder is None:
            from elmo_pipeline.model.pretrained import default_model_files
            folder = os.path.dirname(default_model_files()[0])
        head, vocab, _ = load_exported(folder)
        from elmo_pipeline.model.options import read_options_file
        options = read_options_file(os.path.join(folder, "options.json"))
    corpus = load_corpus_for(args.files, vocab, options, args.tokenizer)
    if corpus.n_windows == 0:     # was perplexity 1.00 over 0 tokens, exit 0
        raise SystemExit(f"error: {' '.join(args.files)}: no tokens to evaluate (empty or only blank lines)")
    result = evaluate(head, corpus, batch_size=args.batch_size).as_dict()
    if args.unigram_baseline:
        from elmo_pipeline.training.data import unigram_perplexity
        train = load_corpus_for(args.unigram_baseline, vocab, options, args.tokenizer)
        result["unigram_ppl"] = unigram_perplexity(train, corpus, len(vocab))
    print(f"perplexity fwd {result['ppl_fwd']:.2f}  bwd {result['ppl_bwd']:.2f}  mean {result['ppl_mean']:.2f}  "
          f"({result['n_tokens']} tokens per direction)", file=sys.stderr)
    print(json.dumps(result))
    if args.json:      # whole, only over nothing or a regular file (never through a link, nor into a FIFO)
        from elmo_pipeline.fsio import atomic_write, url_fs
        atomic_write(url_fs(args.json)[0], args.json, json.dumps(result, indent=2).encode(), files_only=True)
    return 0
