"""`elmo-pipeline train`: train or fine-tune a biLM (training/train.py). Under torchrun: data parallel.

    elmo-pipeline train 'data/*.txt' --valid valid.txt --output runs/x
    elmo-pipeline train new.txt --init-from model/pretrained/wikitext2-small --output runs/ft   # fine-tune
    elmo-pipeline train ... --output runs/x --resume        # continue exactly from the last checkpoint
    python -m torch.distributed.run --nproc_per_node 2 -m elmo_pipeline.pipeline.cli train ...  # 2 processes
Flags override the options file (default: training/train.py DEFAULT_OPTIONS).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags; a count or size below its minimum, or an --output URL, is refused as they are parsed."""
    from elmo_pipeline.pipeline.validate import at_least, finite, local_path
    p.add_argument("train_files", nargs="+", help="training text: paths, fsspec URLs or globs; one sentence/paragraph per line")
    p.add_argument("--output", required=True, type=local_path("folder"), help="run folder, a local path: checkpoints, curves, vocab, export in OUTPUT/model")
    p.add_argument("--valid", nargs="+", help="held-out text, evaluated at every checkpoint")
    p.add_argument("--options", help="options.json with architecture and training keys (missing keys: defaults)")
    p.add_argument("--token-encoder", choices=("char", "word"), help="char CNN (default) or word embeddings")
    p.add_argument("--tokenizer", choices=("whitespace", "raw"), default="whitespace",
                   help="whitespace: pre-tokenized text (default); raw: the project's tokenizer")
    p.add_argument("--vocab-file", help="use this vocabulary (one token per line) instead of building one")
    p.add_argument("--vocab-size", type=at_least(1), help="keep the most frequent words (specials included)")
    p.add_argument("--min-count", type=at_least(1), help="drop words seen fewer times")
    p.add_argument("--n-layers", type=at_least(1))
    p.add_argument("--lstm-dim", type=at_least(1), help="LSTM cell size H")
    p.add_argument("--projection-dim", type=at_least(1), help="LSTM output and token-vector size P")
    p.add_argument("--softmax", choices=("adaptive", "full"))
    p.add_argument("--batch-size", type=at_least(1), help="windows per optimizer step (over all processes)")
    p.add_argument("--unroll-steps", type=at_least(1), help="longest window in tokens; longer lines are cut")
    p.add_argument("--n-epochs", type=at_least(1))
    p.add_argument("--max-steps", type=at_least(1), help="stop after this many steps (the learning-rate schedule ends there)")
    p.add_argument("--lr", type=finite(0, low_open=True), help="learning rate")
    p.add_argument("--optimizer", choices=("adam", "adagrad"))
    p.add_argument("--lr-decay", choices=("linear", "none"))
    p.add_argument("--dropout", type=finite(0, 1))
    p.add_argument("--clip-norm", type=finite(0, meaning="0: off"), help="clip the global gradient norm (0: off)")
    p.add_argument("--init-from", help="fine-tune: folder with options.json + weights.hdf5 [+ vocab.txt]")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    p.add_argument("--stop-after", type=at_least(1), help="end this session at this step (checkpointed; continue with --resume)")
    p.add_argument("--checkpoint-every", type=at_least(1), default=1000, help="steps between checkpoints (default 1000)")
    p.add_argument("--checkpoint-minutes", type=finite(0, low_open=True), help="also checkpoint after this many minutes")
    p.add_argument("--log-every", type=at_least(1), default=50, help="steps per train row in curves.csv (default 50)")
    p.add_argument("--valid-max-windows", type=at_least(1), help="evaluate only the first N held-out windows")
    p.add_argument("--seed", type=at_least(0), help="random seed (default 0; a resumed run keeps its own)")
    p.add_argument("--threads", type=at_least(1), help="torch CPU threads per process")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-export", action="store_true", help="do not export OUTPUT/model at the end")


# The flags that set an option, and its place in options.json (one list: build_options and resume_pins read it).
OPTION_FLAGS = (("n_layers", ("lstm", "n_layers")), ("lstm_dim", ("lstm", "dim")),
                ("projection_dim", ("lstm", "projection_dim")), ("softmax", ("softmax", "type")),
                ("batch_size", ("batch_size",)), ("unroll_steps", ("unroll_steps",)), ("n_epochs", ("n_epochs",)),
                ("dropout", ("dropout",)), ("clip_norm", ("all_clip_norm_val",)),
                ("lr", ("optimizer", "learning_rate")), ("optimizer", ("optimizer", "name")),
                ("lr_decay", ("optimizer", "lr_decay")),
                ("vocab_size", ("vocab", "max_size")), ("min_count", ("vocab", "min_count")))
# Where --init-from gives the options: the model's LSTM shape (a flag for it is refused) and softmax (when it has one).
FROM_THE_MODEL = ("lstm", "softmax")


def build_options(args: argparse.Namespace) -> dict:
    from elmo_pipeline.training.train import default_options
    opts = default_options(args.token_encoder or "char")
    if args.options:
        from elmo_pipeline.model.options import read_options_file
        given = read_options_file(args.options)
        opts.update(given)
        if "char_cnn" not in given and args.token_encoder == "word":
            opts.pop("char_cnn", None)
    if args.token_encoder == "word":
        opts.pop("char_cnn", None)
    for flag, (*parents, key) in OPTION_FLAGS:
        if getattr(args, flag) is not None:
            node = opts
            for name in parents:
                node[name] = node = dict(node.get(name) or {})
            node[key] = getattr(args, flag)
    return opts


def resume_pins(args: argparse.Namespace) -> dict[str, tuple[tuple[str, ...], object]]:
    """What this command line sets explicitly, which a --resume must find in the checkpoint it continues (a
    resumed run keeps its options, seed and tokenizer: a changed flag would be ignored): {flag: (its place in the
    checkpoint's meta, value)}; the architecture flags not with --init-from (the model gives it). An --options
    file pins each key it gives, as these flags make it (its n_tokens_vocab is the vocabulary's; with --init-from
    its architecture is the model's)."""
    pins = {f"--{flag.replace('_', '-')}": (("options", *path), getattr(args, flag)) for flag, path in OPTION_FLAGS
            if getattr(args, flag) is not None and not (args.init_from and path[0] in FROM_THE_MODEL)}
    if args.seed is not None:
        pins["--seed"] = (("seed",), args.seed)
    pins["--tokenizer"] = (("tokenizer",), args.tokenizer)
    if args.token_encoder is not None:
        pins["--token-encoder"] = (("token_encoder",), args.token_encoder)
    if args.options:            # last: a changed flag is named as such, not as the file's key it sets
        from elmo_pipeline.model.options import read_options_file
        given, made = read_options_file(args.options), build_options(args)
        skip = ("n_tokens_vocab", "char_cnn", *FROM_THE_MODEL) if args.init_from else ("n_tokens_vocab",)
        pins.update({f"--options {args.options} ({key!r})": (("options", key), made.get(key)) for key in given
                     if key not in skip})
    return pins


def run(args: argparse.Namespace) -> int:
    from elmo_pipeline.training.train import TrainConfig, train

    shape = [f"--{flag.replace('_', '-')}" for flag, path in OPTION_FLAGS if path[0] == "lstm" and getattr(args, flag)]
    if args.init_from and shape:
        raise ValueError(f"--init-from {args.init_from}: its model gives the LSTM's shape; {shape[0]} cannot change it "
                         "(drop the flag)")
    cfg = TrainConfig(train_files=args.train_files, out_dir=args.output, options=build_options(args),
                      valid_files=args.valid, tokenizer=args.tokenizer, vocab_file=args.vocab_file,
                      init_from=args.init_from, resume=args.resume, max_steps=args.max_steps, stop_after_steps=args.stop_after,
                      checkpoint_every=args.checkpoint_every, checkpoint_minutes=args.checkpoint_minutes,
                      log_every=args.log_every, seed=args.seed or 0, threads=args.threads,
                      progress=not args.no_progress, valid_max_windows=args.valid_max_windows,
                      export=not args.no_export, resume_pins=resume_pins(args) if args.resume else {})
    summary = _under_lease(cfg, train)
    from elmo_pipeline.training.train import dist_info
    if dist_info()[0] == 0:
        print(json.dumps(summary, indent=2), file=sys.stderr)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()     # rank 0 exports and prints first: no rank tears gloo down under a peer still using it
        dist.destroy_process_group()
    return 0


def _under_lease(cfg, train) -> dict:
    """train(cfg) with the run folder's lease (output/lease.py: its _lease.json, the pipeline's) held by the
    process that writes the run's files (rank 0; the other ranks follow its batches): a second run into the same
    folder while this one lives is one `error:` line (its checkpoints and curves were mixed into this one's). A
    killed run's lease is taken over (its process gone, or its heartbeat older than 60 s)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return train(cfg)
    from elmo_pipeline.output.lease import Lease, LeaseHeld
    from elmo_pipeline.output.names import LEASE
    os.makedirs(cfg.out_dir, exist_ok=True)
    try:
        lease = Lease(os.path.join(cfg.out_dir, LEASE)).acquire()
    except LeaseHeld as e:
        raise SystemExit(f"error: --output {str(e).split('; it is taken over')[0]}; rerun once it has ended (a killed "
                         "run's lease is taken over: at once on its machine, else after 60 s)") from None
    try:
        return train(cfg)
    finally:
        lease.release()


def main(argv: list[str] | None = None) -> int:
    """Entry point without the other subcommands' imports: python -m elmo_pipeline.pipeline.train_command ... (torchrun)."""
    from elmo_pipeline.pipeline.validate import OneLineParser
    parser = OneLineParser(prog="elmo-pipeline train")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":     # torchrun's entry: each rank ends a failure with one `error:` line, as `elmo-pipeline`
    from elmo_pipeline.pipeline.cli import console
    console(["train", *sys.argv[1:]])
