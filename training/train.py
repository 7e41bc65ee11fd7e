"""Train, fine-tune, evaluate and export biLMs (plain PyTorch; torchrun for data parallel).

Modules: training/data.py (corpus, vocabulary, batches), training/head.py (biLM + softmax, perplexity),
training/export.py (bilm-tf export), training/checkpoint.py (HDF5 checkpoints), training/curves.py (PNG).

One options.json holds the architecture (bilm-tf keys: lstm, char_cnn, n_tokens_vocab) and the training
settings (bilm-tf keys: batch_size, unroll_steps, n_epochs, dropout, all_clip_norm_val; ours: softmax,
optimizer, vocab). The forward and backward LMs share the token encoder and the softmax; the training
loss is the mean of both directions' per-token negative log-likelihoods (nats).

Output folder of a run:
  options.json, vocab.txt             written at the start (a folder holding a run's files: only with --resume)
  checkpoints/ckpt-<step>.h5          every `checkpoint_every` steps and at the end (training/checkpoint.py)
  curves.csv, curves.png              train loss every `log_every` steps, held-out perplexity per checkpoint
  model/options.json, weights.hdf5, vocab.txt, sha256sums.txt   the export: what load_bilm, AllenNLP and bilm-tf read
"""
from __future__ import annotations

import copy
import csv
import json
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from elmo_pipeline.training.checkpoint import check_vocab, load_checkpoint, read_meta, save_checkpoint, tokens_digest
from elmo_pipeline.training.data import Corpus, build_vocabulary, encode_corpus, epoch_batches, get_tokenizer, read_lines
from elmo_pipeline.training.export import (check_export_targets, check_exported, export_model,  # noqa: F401 (API)
                                           head_from_checkpoint, load_exported, load_softmax)
from elmo_pipeline.training.head import LMHead, Perplexity, batch_maker, build_model, evaluate  # noqa: F401 (API)
from elmo_pipeline.model.vocab import Vocabulary
from elmo_pipeline.fsio import only_a_file, replacing
from elmo_pipeline.model.options import read_options_file
from elmo_pipeline.model.weights import load_weights_into, write_json

CHAR_CNN = {"activation": "relu", "embedding": {"dim": 16},
            "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 256]],
            "max_characters_per_token": 50, "n_characters": 262, "n_highway": 1}

# The default training options: a small char-CNN biLM that trains on a 2-core CPU.
DEFAULT_OPTIONS = {
    "bidirectional": True,
    "char_cnn": CHAR_CNN,
    "lstm": {"cell_clip": 3, "proj_clip": 3, "n_layers": 2, "dim": 512, "projection_dim": 128,
             "use_skip_connections": True},
    "dropout": 0.1,
    "batch_size": 32,
    "unroll_steps": 60,            # longest window, in tokens (longer lines are cut into windows)
    "n_epochs": 1,
    "all_clip_norm_val": 1.0,
    "softmax": {"type": "adaptive", "cutoffs": [2000, 10000], "div_value": 4.0},
    "optimizer": {"name": "adam", "learning_rate": 0.002, "lr_decay": "linear"},
    "vocab": {"max_size": None, "min_count": 1},
}


def default_options(token_encoder: str = "char") -> dict:
    opts = copy.deepcopy(DEFAULT_OPTIONS)
    if token_encoder == "word":
        del opts["char_cnn"]
    elif token_encoder != "char":
        raise ValueError(f"token encoder should be 'char' or 'word', found {token_encoder!r}")
    return opts


# --- distributed --------------------------------------------------------------------------------

def dist_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) when not under torchrun."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed() -> None:
    """Join the torchrun process group (gloo on CPU, nccl on GPU) when WORLD_SIZE > 1."""
    import torch.distributed as dist
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _all_reduce_grads(params: list[nn.Parameter]) -> None:
    import torch.distributed as dist
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset: offset + n].view_as(p).clone()
        offset += n


# --- training -----------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    train_files: list[str]
    out_dir: str
    options: dict = field(default_factory=default_options)
    valid_files: list[str] | None = None
    tokenizer: str = "whitespace"
    vocab_file: str | None = None           # use this vocabulary instead of building one
    init_from: str | None = None            # exported folder (options.json, weights.hdf5[, vocab.txt])
    resume: bool = False
    max_steps: int | None = None            # stop after this many optimizer steps (default: n_epochs)
    stop_after_steps: int | None = None     # end this session at this step, as if interrupted (checkpoint kept,
                                            # no export, schedule unchanged); continue with resume=True
    checkpoint_every: int = 1000            # steps; and at the end
    checkpoint_minutes: float | None = None  # also checkpoint when this much time has passed since the last
    log_every: int = 50
    keep_checkpoints: int = 3
    seed: int = 0
    threads: int | None = None
    progress: bool = True
    valid_max_windows: int | None = None
    export: bool = True
    resume_pins: dict = field(default_factory=dict)   # {flag: (place in a checkpoint's meta, value)} a --resume must
                                                      # find there (pipeline/train_command.resume_pins)


def _log(msg: str) -> None:
    if dist_info()[0] == 0:
        print(msg, file=sys.stderr, flush=True)


CHECKPOINT = re.compile(r"ckpt-\d{8}\.h5")     # a run's own checkpoint names (checkpoint(): ckpt-<step:08d>.h5)
CHECKPOINT_TEMP = re.compile(r"ckpt-\d{8}\.h5\.tmp-[0-9a-f]{32}")   # fsio.temp_name of one being written
RUN_FILES = ("options.json", "vocab.txt", "curves.csv", "curves.png", "model")   # a run's other names in its folder


def _checkpoints(out_dir: str) -> list[str]:
    """The run's own checkpoints in `out_dir`, oldest first: only names checkpoint() writes (a user's ckpt-best.h5
    is never rotated away nor taken for the latest)."""
    folder = os.path.join(out_dir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in sorted(n for n in names if CHECKPOINT.fullmatch(n))]


def _remove_checkpoint_temps(out_dir: str) -> None:
    """The temporary files of checkpoints a killed run was writing (ckpt-<step>.h5.tmp-<hex>, regular files only)."""
    folder = os.path.join(out_dir, "checkpoints")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if CHECKPOINT_TEMP.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)


COUNTS = ("batch_size", "unroll_steps", "n_epochs")    # training options that must be integers >= 1


def check_counts(options: dict) -> None:
    """ValueError naming the key when a count of the options (COUNTS: from --options or a flag) is no integer >= 1
    (0 divided by zero once training had started)."""
    for key in COUNTS:
        value = options.get(key, 1)
        if type(value) is not int or value < 1:
            raise ValueError(f"options: {key} must be an integer >= 1, got {value!r}")


def check_restart(out_dir: str, options: dict) -> None:
    """ValueError unless a --resume that finds no checkpoint may start the run again in `out_dir`: the folder holds
    at most the files a run writes before its first checkpoint (options.json, vocab.txt, curves), its options.json,
    where there is one, being the options this command builds (the same run, killed early). A folder holding an
    export, or the files of a run of other options, is left as it is (it was replaced by a run from scratch)."""
    held = [n for n in RUN_FILES if os.path.lexists(os.path.join(out_dir, n))]
    if not held:
        return
    for name in held:                   # a link, a FIFO or a folder at a file's name: as a write would refuse it
        if name not in ("model", "curves.png"):       # (a link at curves.png only leaves the drawing out)
            only_a_file(os.path.join(out_dir, name))
    if "model" in held:
        raise ValueError(f"--resume: {out_dir} holds no checkpoint to resume from but a finished run's export "
                         "(model/): it is left as it is; train into another folder")
    recorded = os.path.join(out_dir, "options.json")
    if os.path.lexists(recorded) and read_options_file(recorded) != json.loads(json.dumps(options)):
        raise ValueError(f"--resume: {out_dir} holds no checkpoint to resume from, and its files are not this "
                         "command's run (its options.json differs from the options these flags give): give the flags "
                         "that started it, or train into another folder")


def check_fresh_output(out_dir: str) -> None:
    """ValueError unless `out_dir` holds none of a run's files (a run starting without --resume): a folder holding a
    run, or a user's files of those names, is left as it is (before, a second run rotated the first's checkpoints
    in among its own and replaced its options and vocabulary)."""
    held = [n for n in RUN_FILES if os.path.lexists(os.path.join(out_dir, n))] + [
        os.path.join("checkpoints", os.path.basename(p)) for p in _checkpoints(out_dir)]
    if held:
        raise ValueError(f"--output {out_dir} holds a training run's files ({held[0]}): pass --resume to continue "
                         "that run, or name another folder; nothing there is changed")


def latest_checkpoint(out_dir: str) -> str | None:
    found = _checkpoints(out_dir)
    return found[-1] if found else None


def _prepare_vocab_and_options(cfg: TrainConfig, tokenize) -> tuple[dict, Vocabulary, bool]:
    """(options, vocabulary, whether --init-from's softmax may be reused: not over another vocabulary)."""
    options, reuse_softmax = copy.deepcopy(cfg.options), True
    vocab = Vocabulary.load(cfg.vocab_file) if cfg.vocab_file else None
    if cfg.init_from:
        check_exported(cfg.init_from)           # whole, its files as its sha256sums.txt records them
        init_opts = read_options_file(os.path.join(cfg.init_from, "options.json"))
        for key in ("lstm", "char_cnn", "n_tokens_vocab"):    # the architecture comes from the model
            options.pop(key, None)
            if key in init_opts:
                options[key] = init_opts[key]
        if init_opts.get("softmax"):      # so that the model's trained softmax can be reused
            options["softmax"] = init_opts["softmax"]
        own = os.path.join(cfg.init_from, "vocab.txt")
        if vocab is not None and os.path.isfile(own) and Vocabulary.load(own).tokens != vocab.tokens:
            if "char_cnn" not in options:     # its embedding has a row per word of its own vocabulary
                raise ValueError(f"--init-from {cfg.init_from}: a word-encoder model's embedding rows are the words "
                                 f"of its vocab.txt; --vocab-file {cfg.vocab_file} is another vocabulary")
            reuse_softmax = False      # the model's softmax rows are its words': a new softmax
        if vocab is None and os.path.isfile(own):
            vocab = Vocabulary.load(own)
        if vocab is None and "char_cnn" not in options:
            raise ValueError(f"--init-from {cfg.init_from}: a word-encoder model needs its vocab.txt")
    if vocab is None:
        spec = options.get("vocab") or {}
        counts = Counter(t for line in read_lines(cfg.train_files, tokenize) for t in line)
        vocab = build_vocabulary(counts, spec.get("max_size"), int(spec.get("min_count", 1)))
    options["n_tokens_vocab"] = len(vocab)
    return options, vocab, reuse_softmax


_UNRECORDED = object()


def check_pins(ckpt: str, meta: dict, pins: dict) -> None:
    """ValueError, one line, unless every flag of a --resume command line (TrainConfig.resume_pins) is what the
    run recorded in its checkpoint (a value it does not record, an earlier version's, passes): a resumed run keeps
    its options, seed and tokenizer, so a changed one would be ignored without a word."""
    for flag, (place, value) in pins.items():
        recorded = meta
        for name in place:
            recorded = recorded.get(name, _UNRECORDED) if isinstance(recorded, dict) else _UNRECORDED
        if recorded is not _UNRECORDED and recorded != value:
            raise ValueError(f"--resume: {flag} {value} but the run in {ckpt} was trained with {recorded}: a resumed "
                             "run keeps its options; give its value, or start a new run in another folder")


def train(cfg: TrainConfig) -> dict:
    """Train (or resume, or fine-tune) a biLM. Returns a summary dict (steps, losses, held-out perplexity)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    init_distributed()
    rank, world = dist_info()
    tokenize = get_tokenizer(cfg.tokenizer)
    if not cfg.resume and rank == 0:         # the rank that writes the run's files (the others wait for its batches)
        check_fresh_output(cfg.out_dir)
    os.makedirs(os.path.join(cfg.out_dir, "checkpoints"), exist_ok=True)
    if rank == 0:
        _remove_checkpoint_temps(cfg.out_dir)
    ckpt = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    seed = cfg.seed
    if ckpt:
        meta = read_meta(ckpt)
        options = meta["options"]
        vocab = Vocabulary.load(os.path.join(cfg.out_dir, "vocab.txt"))
        check_vocab(ckpt, meta, vocab.tokens, os.path.join(cfg.out_dir, "vocab.txt"))
        check_pins(ckpt, {**meta, "token_encoder": "char" if "char_cnn" in meta["options"] else "word"},
                   cfg.resume_pins)
        if type(meta.get("seed")) is int:   # the run's data order and dropout masks, whatever --seed says now
            seed = meta["seed"]
    else:
        options, vocab, reuse_softmax = _prepare_vocab_and_options(cfg, tokenize)
        check_counts(options)
        if cfg.resume and rank == 0:
            check_restart(cfg.out_dir, options)
            _log(f"--resume: no checkpoint in {cfg.out_dir}/checkpoints, starting the run from scratch")

    batch_size = int(options.get("batch_size", 32))
    if batch_size % world:
        raise ValueError(f"batch_size {batch_size} must be divisible by the number of processes ({world})")
    max_tokens = int(options.get("unroll_steps", 60))
    corpus = encode_corpus(read_lines(cfg.train_files, tokenize), vocab, max_tokens)
    corpus_sha256 = corpus.digest()
    if ckpt and meta.get("corpus_sha256") not in (None, corpus_sha256):
        raise ValueError(f"--resume: the training text is not the one {ckpt} was trained on (its windows' SHA-256 "
                         "differs): resume with the same files, or start a new run in another folder")
    valid = encode_corpus(read_lines(cfg.valid_files, tokenize), vocab, max_tokens) if cfg.valid_files else None
    if valid is not None and valid.n_windows == 0:
        raise ValueError(f"--valid {' '.join(cfg.valid_files)}: no tokens to evaluate (empty or only blank lines)")
    n_epochs = int(options.get("n_epochs", 1))
    per_epoch = len(corpus.lengths) // batch_size
    if per_epoch == 0:
        raise ValueError(f"the corpus has {corpus.n_windows} windows, fewer than batch_size {batch_size}")
    total_steps = (cfg.max_steps if cfg.max_steps is not None else   # a resumed run keeps its schedule
                   int(meta["total_steps"]) if ckpt and "total_steps" in meta else n_epochs * per_epoch)

    if rank == 0 and os.path.isdir(os.path.join(cfg.out_dir, "model")):   # what the final export would refuse, now
        check_export_targets(os.path.join(cfg.out_dir, "model"))
    if rank == 0 and not ckpt:      # the run's files once its data is checked: a failed start leaves none
        write_json(os.path.join(cfg.out_dir, "options.json"), options)
        vocab.save(os.path.join(cfg.out_dir, "vocab.txt"))
    torch.manual_seed(seed)
    head = build_model(options, vocab)
    opt_spec = options.get("optimizer") or {}
    lr = float(opt_spec.get("learning_rate", 0.002))
    name = opt_spec.get("name", "adam").lower()
    if name == "adam":
        optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    elif name == "adagrad":   # bilm-tf's optimizer (lr 0.2, initial accumulator 1.0)
        optimizer = torch.optim.Adagrad(head.parameters(), lr=lr, initial_accumulator_value=1.0)
    else:
        raise ValueError(f"options.json: optimizer.name should be 'adam' or 'adagrad', found {name!r}")
    step, elapsed, tokens_seen = 0, 0.0, 0
    if ckpt:
        meta = load_checkpoint(ckpt, head.bilm, head.softmax, optimizer)
        step, elapsed, tokens_seen = meta["step"], meta["elapsed_s"], meta["tokens"]
        _log(f"resumed from {ckpt} at step {step}")
    elif cfg.init_from:
        load_weights_into(head.bilm, os.path.join(cfg.init_from, "weights.hdf5"))
        got = reuse_softmax and load_softmax(head, os.path.join(cfg.init_from, "weights.hdf5"))
        _log(f"initialised from {cfg.init_from} (softmax {'reused' if got else 'new'})")
        torch.manual_seed(seed + 1)

    if world > 1:   # the same initial weights everywhere, but each process its own dropout masks
        torch.manual_seed(seed * 1_000_003 + step * 101 + rank)
    clip = options.get("all_clip_norm_val")
    decay = opt_spec.get("lr_decay", "none")
    params = [p for p in head.parameters()]
    maker = batch_maker(head, corpus)
    curves = CurveLog(os.path.join(cfg.out_dir, "curves.csv"), enabled=rank == 0, truncate_after=step if ckpt else 0)
    bar = _progress(cfg.progress and rank == 0, total_steps, step)
    head.train()
    last_ckpt_time = time.monotonic()
    acc_f = acc_b = 0.0
    acc_n = 0
    t0 = time.monotonic() - elapsed
    summary: dict = {}

    def checkpoint() -> None:
        nonlocal last_ckpt_time
        meta = {"step": step, "epoch": step // per_epoch, "batch_in_epoch": step % per_epoch,
                "tokens": tokens_seen, "elapsed_s": time.monotonic() - t0, "options": options,
                "seed": seed, "tokenizer": cfg.tokenizer, "world_size": world, "total_steps": total_steps,
                "vocab_sha256": tokens_digest(vocab.tokens), "corpus_sha256": corpus_sha256}
        if valid is not None:
            ppl = evaluate(head, valid, max_windows=cfg.valid_max_windows)
            meta["valid"] = ppl.as_dict()
            summary["valid"] = ppl.as_dict()
            curves.write(step, meta["epoch"], tokens_seen, meta["elapsed_s"], "valid", ppl.loss_fwd, ppl.loss_bwd,
                         _lr(optimizer))
            _log(f"step {step}: valid perplexity fwd {ppl.ppl_fwd:.1f} bwd {ppl.ppl_bwd:.1f} mean {ppl.ppl_mean:.1f}")
        if rank == 0:
            path = os.path.join(cfg.out_dir, "checkpoints", f"ckpt-{step:08d}.h5")
            save_checkpoint(path, head.bilm, head.softmax, optimizer, meta)
            for old in _checkpoints(cfg.out_dir)[:-max(1, cfg.keep_checkpoints)]:
                os.remove(old)
            curves.plot()
        last_ckpt_time = time.monotonic()

    end = min(total_steps, cfg.stop_after_steps) if cfg.stop_after_steps is not None else total_steps
    while step < end:
        epoch, pos = divmod(step, per_epoch)
        batches = epoch_batches(corpus.lengths, batch_size, seed, epoch)
        for ids in batches[pos:]:
            if step >= end:
                break
            if decay == "linear":
                for g in optimizer.param_groups:
                    g["lr"] = lr * max(0.0, 1.0 - step / total_steps)
            full = maker(ids)
            n_global = full.n_predicted
            b = maker(ids[rank::world]) if world > 1 else full
            optimizer.zero_grad(set_to_none=True)
            f_sum, b_sum = head.nll_sums(b.inputs, b.lengths, b.targets)
            loss = (f_sum + b_sum) / (2 * n_global)
            loss.backward()
            if world > 1:
                _all_reduce_grads(params)
                sums = torch.stack([f_sum.detach(), b_sum.detach()])
                import torch.distributed as dist
                dist.all_reduce(sums)
                fs, bs = float(sums[0]), float(sums[1])
            else:
                fs, bs = float(f_sum.detach()), float(b_sum.detach())
            if clip:
                torch.nn.utils.clip_grad_norm_(params, float(clip))
            optimizer.step()
            step += 1
            tokens_seen += n_global
            acc_f, acc_b, acc_n = acc_f + fs, acc_b + bs, acc_n + n_global
            if bar is not None:
                bar.update(1)
                el = time.monotonic() - t0
                bar.set_postfix_str(f"loss {(fs + bs) / (2 * n_global):.3f} tok/s {tokens_seen / max(el, 1e-9):.0f}", refresh=False)
            if step % cfg.log_every == 0 or step == total_steps:
                curves.write(step, step // per_epoch, tokens_seen, time.monotonic() - t0, "train",
                             acc_f / acc_n, acc_b / acc_n, _lr(optimizer))
                summary["train_loss"] = (acc_f + acc_b) / (2 * acc_n)
                acc_f = acc_b = 0.0
                acc_n = 0
            due_time = cfg.checkpoint_minutes and time.monotonic() - last_ckpt_time > 60 * cfg.checkpoint_minutes
            if step < total_steps and (step % cfg.checkpoint_every == 0 or due_time):
                checkpoint()
    if bar is not None:
        bar.close()
    checkpoint()
    if cfg.export and rank == 0 and step >= total_steps:
        export_model(head, vocab, os.path.join(cfg.out_dir, "model"))
    summary.update(step=step, tokens=tokens_seen, elapsed_s=time.monotonic() - t0, n_params=sum(p.numel() for p in head.bilm.parameters()))
    return summary


def _lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                mininterval=1.0 if sys.stderr.isatty() else 30.0)


class CurveLog:
    """curves.csv: step, epoch, tokens, elapsed_s, split, loss_fwd, loss_bwd, ppl_fwd, ppl_bwd, ppl_mean, lr.
    On resume, rows after the checkpoint's step are dropped so the file continues exactly."""

    FIELDS = ["step", "epoch", "tokens", "elapsed_s", "split", "loss_fwd", "loss_bwd", "ppl_fwd", "ppl_bwd", "ppl_mean", "lr"]

    def __init__(self, path: str, enabled: bool = True, truncate_after: int = 0):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        only_a_file(path)       # a link there is never written through (nor appended to), a FIFO never opened
        rows = read_curves(path) if truncate_after and os.path.exists(path) else []
        rows = [r for r in rows if int(r["step"]) <= truncate_after]
        with replacing(path, files_only=True) as tmp, open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.FIELDS)
            w.writeheader()
            w.writerows(rows)

    def write(self, step, epoch, tokens, elapsed, split, loss_f, loss_b, lr) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([step, epoch, tokens, f"{elapsed:.1f}", split, f"{loss_f:.6f}", f"{loss_b:.6f}",
                                    f"{math.exp(loss_f):.3f}", f"{math.exp(loss_b):.3f}",
                                    f"{math.exp((loss_f + loss_b) / 2):.3f}", f"{lr:.6g}"])

    def plot(self) -> None:
        if self.enabled:
            from elmo_pipeline.training.curves import has_curves, plot_curves
            if not has_curves(self.path):           # nothing to draw yet: no file written, nothing to rename
                return
            try:
                with replacing(os.path.splitext(self.path)[0] + ".png", files_only=True) as tmp:
                    plot_curves(self.path, tmp)
            except Exception as e:   # a plot must never stop training
                _log(f"could not draw {self.path} as PNG: {e}")


def read_curves(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_corpus_for(files: Sequence[str] | str, vocab: Vocabulary, options: dict, tokenizer: str = "whitespace") -> Corpus:
    """Encode held-out files the way training encodes its corpus (same windows)."""
    return encode_corpus(read_lines(files, get_tokenizer(tokenizer)), vocab, int(options.get("unroll_steps", 60)))
