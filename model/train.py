"""Train, fine-tune, evaluate and export biLMs (plain PyTorch; torchrun for data parallel).

One options.json holds the architecture (bilm-tf keys: lstm, char_cnn, n_tokens_vocab) and the training
settings (bilm-tf keys: batch_size, unroll_steps, n_epochs, dropout, all_clip_norm_val; ours: softmax,
optimizer, vocab). The forward and backward LMs share the token encoder and the softmax; the training
loss is the mean of both directions' per-token negative log-likelihoods (nats).

Output folder of a run:
  options.json, vocab.txt             written at the start
  checkpoints/ckpt-<step>.h5          every `checkpoint_every` steps and at the end (model/checkpoint.py)
  curves.csv, curves.png              train loss every `log_every` steps, held-out perplexity per checkpoint
  model/options.json, weights.hdf5, vocab.txt   the export: what load_bilm, AllenNLP and bilm-tf read
"""
from __future__ import annotations

import copy
import csv
import glob
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import h5py
import numpy as np
import torch
from torch import Tensor, nn

from model.bilm import BiLM
from model.checkpoint import load_checkpoint, read_meta, save_checkpoint
from model.lm_data import (BatchMaker, Corpus, build_vocabulary, encode_corpus, epoch_batches, eval_batches,
                           get_tokenizer, read_lines)
from model.options import parse_options
from model.padded_forward import top_layer
from model.softmax import build_softmax
from model.vocab import Vocabulary
from model.weights import load_weights_into, save_bilm

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


# --- the model with its softmax -----------------------------------------------------------------

class LMHead(nn.Module):
    """A BiLM plus the softmax both directions share. nll_sums(batch) -> (sum fwd, sum bwd) in nats."""

    def __init__(self, options: dict, vocab_size: int):
        super().__init__()
        self.opts = parse_options(options)
        self.bilm = BiLM(self.opts, dropout=float(options.get("dropout", 0.0)))
        self.softmax = build_softmax(options.get("softmax"), self.opts.projection_dim, vocab_size)

    def nll_sums(self, inputs: Tensor, lengths: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        top_f, top_b = top_layer(self.bilm, inputs, lengths)         # (B, T, P) each
        T = top_f.shape[1]
        # position t predicts t + 1 (forward) and t + 1 predicts t (backward), for t + 1 < length
        m = torch.arange(T - 1, device=top_f.device)[None, :] < (lengths.to(top_f.device)[:, None] - 1)
        fwd = self.softmax.nll(top_f[:, :-1][m], targets[:, 1:][m])
        bwd = self.softmax.nll(top_b[:, 1:][m], targets[:, :-1][m])
        return fwd.sum(), bwd.sum()


def build_model(options: dict, vocab: Vocabulary) -> LMHead:
    options = dict(options)
    options["n_tokens_vocab"] = len(vocab)
    return LMHead(options, len(vocab))


# --- evaluation ---------------------------------------------------------------------------------

@dataclass
class Perplexity:
    loss_fwd: float
    loss_bwd: float
    n_tokens: int

    @property
    def ppl_fwd(self) -> float:
        return math.exp(self.loss_fwd)

    @property
    def ppl_bwd(self) -> float:
        return math.exp(self.loss_bwd)

    @property
    def ppl_mean(self) -> float:
        """exp of the mean of both directions' losses (the geometric mean of the two perplexities)."""
        return math.exp((self.loss_fwd + self.loss_bwd) / 2)

    def as_dict(self) -> dict:
        return {"ppl_fwd": self.ppl_fwd, "ppl_bwd": self.ppl_bwd, "ppl_mean": self.ppl_mean,
                "loss_fwd": self.loss_fwd, "loss_bwd": self.loss_bwd, "n_tokens": self.n_tokens}


@torch.no_grad()
def evaluate(head: LMHead, corpus: Corpus, batch_size: int = 64, max_windows: int | None = None) -> Perplexity:
    """Exact perplexities of both directions over every window of `corpus` (state starts at zero per window)."""
    was_training = head.training
    head.eval()
    maker = batch_maker(head, corpus)
    lengths = corpus.lengths if max_windows is None else corpus.lengths[:max_windows]
    sf = sb = 0.0
    n = 0
    for ids in eval_batches(lengths, batch_size):
        b = maker(ids)
        f, bw = head.nll_sums(b.inputs, b.lengths, b.targets)
        sf, sb, n = sf + float(f), sb + float(bw), n + b.n_predicted
    head.train(was_training)
    return Perplexity(sf / max(n, 1), sb / max(n, 1), n)


def _max_chars(head: LMHead) -> int:
    return head.opts.max_characters_per_token if head.opts.char_cnn is not None else 50


def batch_maker(head: LMHead, corpus: Corpus) -> BatchMaker:
    char = head.opts.char_cnn is not None
    return BatchMaker(corpus, char, _max_chars(head), max(w for w, _ in head.opts.filters) if char else None)


# --- export / import ----------------------------------------------------------------------------

def export_model(head: LMHead, vocab: Vocabulary, folder: str, include_softmax: bool = True) -> tuple[str, str, str]:
    """options.json + weights.hdf5 (bilm-tf layout; the softmax as extra 'softmax/...' datasets that
    inference loaders ignore) + vocab.txt. Returns the three paths."""
    os.makedirs(folder, exist_ok=True)
    opts_path, weights_path, vocab_path = (os.path.join(folder, n) for n in ("options.json", "weights.hdf5", "vocab.txt"))
    save_bilm(head.bilm, opts_path, weights_path)
    if include_softmax:
        with h5py.File(weights_path, "a") as f:
            for name, t in head.softmax.state_dict().items():
                f[f"softmax/{name}"] = t.detach().cpu().float().numpy()
    vocab.save(vocab_path)
    return opts_path, weights_path, vocab_path


def load_exported(folder: str, require_softmax: bool = True) -> tuple[LMHead, Vocabulary, bool]:
    """(head, vocab, softmax_loaded) from an exported folder (options.json, weights.hdf5, vocab.txt)."""
    with open(os.path.join(folder, "options.json")) as f:
        options = json.load(f)
    vocab_path = os.path.join(folder, "vocab.txt")
    if not os.path.isfile(vocab_path):
        raise FileNotFoundError(f"{folder}: no vocab.txt (needed for the softmax)")
    vocab = Vocabulary.load(vocab_path)
    head = build_model(options, vocab)
    weights = os.path.join(folder, "weights.hdf5")
    load_weights_into(head.bilm, weights)
    loaded = load_softmax(head, weights)
    if require_softmax and not loaded:
        raise ValueError(f"{weights} holds no softmax (an inference-only export): perplexity needs it")
    return head, vocab, loaded


def load_softmax(head: LMHead, weights_path: str) -> bool:
    """Fill head.softmax from a weights.hdf5's 'softmax/...' datasets when present and of the right shapes."""
    want = head.softmax.state_dict()
    with h5py.File(weights_path, "r") as f:
        if "softmax" not in f:
            return False
        got = {}
        f["softmax"].visititems(lambda n, o: got.__setitem__(n, torch.from_numpy(o[()])) if isinstance(o, h5py.Dataset) else None)
    if set(got) != set(want) or any(got[k].shape != want[k].shape for k in want):
        return False
    head.softmax.load_state_dict(got)
    return True


def head_from_checkpoint(path: str) -> tuple[LMHead, Vocabulary, dict]:
    """(head, vocab, meta) from a checkpoint file; its vocab.txt is the run folder's (one level up)."""
    meta = read_meta(path)
    vocab = Vocabulary(meta["vocab"]) if "vocab" in meta else Vocabulary.load(
        os.path.join(os.path.dirname(os.path.dirname(path)), "vocab.txt"))
    head = build_model(meta["options"], vocab)
    load_checkpoint(path, head.bilm, head.softmax, restore_rng=False)
    return head.eval(), vocab, meta


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


def _log(msg: str) -> None:
    if dist_info()[0] == 0:
        print(msg, file=sys.stderr, flush=True)


def _checkpoints(out_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out_dir, "checkpoints", "ckpt-*.h5")))


def latest_checkpoint(out_dir: str) -> str | None:
    found = _checkpoints(out_dir)
    return found[-1] if found else None


def _prepare_vocab_and_options(cfg: TrainConfig, tokenize) -> tuple[dict, Vocabulary]:
    options = copy.deepcopy(cfg.options)
    vocab = Vocabulary.load(cfg.vocab_file) if cfg.vocab_file else None
    if cfg.init_from:
        with open(os.path.join(cfg.init_from, "options.json")) as f:
            init_opts = json.load(f)
        for key in ("lstm", "char_cnn", "n_tokens_vocab"):    # the architecture comes from the model
            options.pop(key, None)
            if key in init_opts:
                options[key] = init_opts[key]
        options.setdefault("softmax", init_opts.get("softmax"))
        if vocab is None and os.path.isfile(os.path.join(cfg.init_from, "vocab.txt")):
            vocab = Vocabulary.load(os.path.join(cfg.init_from, "vocab.txt"))
        if vocab is None and "char_cnn" not in options:
            raise ValueError(f"--init-from {cfg.init_from}: a word-encoder model needs its vocab.txt")
    if vocab is None:
        spec = options.get("vocab") or {}
        counts = Counter(t for line in read_lines(cfg.train_files, tokenize) for t in line)
        vocab = build_vocabulary(counts, spec.get("max_size"), int(spec.get("min_count", 1)))
    options["n_tokens_vocab"] = len(vocab)
    return options, vocab


def train(cfg: TrainConfig) -> dict:
    """Train (or resume, or fine-tune) a biLM. Returns a summary dict (steps, losses, held-out perplexity)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    init_distributed()
    rank, world = dist_info()
    tokenize = get_tokenizer(cfg.tokenizer)
    os.makedirs(os.path.join(cfg.out_dir, "checkpoints"), exist_ok=True)
    ckpt = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        _log(f"--resume: no checkpoint in {cfg.out_dir}/checkpoints, starting from scratch")
    if ckpt:
        meta = read_meta(ckpt)
        options = meta["options"]
        vocab = Vocabulary.load(os.path.join(cfg.out_dir, "vocab.txt"))
    else:
        options, vocab = _prepare_vocab_and_options(cfg, tokenize)
        if rank == 0:
            with open(os.path.join(cfg.out_dir, "options.json"), "w") as f:
                json.dump(options, f, indent=2, sort_keys=True)
            vocab.save(os.path.join(cfg.out_dir, "vocab.txt"))

    batch_size = int(options.get("batch_size", 32))
    if batch_size % world:
        raise ValueError(f"batch_size {batch_size} must be divisible by the number of processes ({world})")
    max_tokens = int(options.get("unroll_steps", 60))
    corpus = encode_corpus(read_lines(cfg.train_files, tokenize), vocab, max_tokens)
    valid = encode_corpus(read_lines(cfg.valid_files, tokenize), vocab, max_tokens) if cfg.valid_files else None
    n_epochs = int(options.get("n_epochs", 1))
    per_epoch = len(corpus.lengths) // batch_size
    if per_epoch == 0:
        raise ValueError(f"the corpus has {corpus.n_windows} windows, fewer than batch_size {batch_size}")
    total_steps = cfg.max_steps if cfg.max_steps is not None else n_epochs * per_epoch

    torch.manual_seed(cfg.seed)
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
        got = load_softmax(head, os.path.join(cfg.init_from, "weights.hdf5"))
        _log(f"initialised from {cfg.init_from} (softmax {'reused' if got else 'new'})")
        torch.manual_seed(cfg.seed + 1)

    if world > 1:   # the same initial weights everywhere, but each process its own dropout masks
        torch.manual_seed(cfg.seed * 1_000_003 + step * 101 + rank)
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
                "seed": cfg.seed, "world_size": world, "total_steps": total_steps}
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
        batches = epoch_batches(corpus.lengths, batch_size, cfg.seed, epoch)
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
        rows = read_curves(path) if truncate_after and os.path.exists(path) else []
        rows = [r for r in rows if int(r["step"]) <= truncate_after]
        with open(path, "w", newline="") as f:
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
            from model.curves import plot_curves
            try:
                plot_curves(self.path, os.path.splitext(self.path)[0] + ".png")
            except Exception as e:   # a plot must never stop training
                _log(f"could not draw {self.path} as PNG: {e}")


def read_curves(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_corpus_for(files: Sequence[str] | str, vocab: Vocabulary, options: dict, tokenizer: str = "whitespace") -> Corpus:
    """Encode held-out files the way training encodes its corpus (same windows)."""
    return encode_corpus(read_lines(files, get_tokenizer(tokenizer)), vocab, int(options.get("unroll_steps", 60)))
