"""Training the probe: one classifier per layer setting, fitted on a train split, selected on dev.

Classifiers (downstream.heads) by task: sentence / mlp, bilstm, linear; token: a linear tagger. For linear
settings (single layers, scalar mixes; downstream.combine) the mlp and linear sentence classifiers read
per-layer means (batches "pooled", downstream.splits) and mix after pooling: the same result, as both are
linear.
Optimizers, cross-entropy loss: a linear head (token tagger, sentence linear) on a linear combination is a
logistic regression, fitted by full-batch L-BFGS to convergence (no dropout; optional l2 on the head's
weights); everything else by minibatch Adam with dropout. With a dev split the state with the best dev
accuracy (Adam: per epoch; L-BFGS: every `lbfgs_check` iterations) is kept and its scores reported, else
the last. train_setting returns, per split, accuracy and macro-F1 (fractions; downstream.metrics), and
the seconds it took.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from elmo_pipeline.downstream.combine import make_combiner
from elmo_pipeline.downstream.heads import LinearHead, SentenceBiLSTM, SentenceLinear, SentenceMLP, Standardized, TokenTagger
from elmo_pipeline.downstream.metrics import accuracy, scores
from elmo_pipeline.downstream.splits import Split, batches, n_rows


OPTIMIZERS = ("auto", "lbfgs", "adam")


@dataclass
class ProbeConfig:
    task: str = "sentence"            # sentence | token
    classifier: str = "mlp"           # mlp | bilstm | linear (sentence task)
    epochs: int = 20                  # adam: epochs; lbfgs: dev checks (every `lbfgs_check` iterations) at most
    batch_size: int = 32
    lr: float = 1e-3
    hidden: int = 256
    dropout: float = 0.3              # adam only (lbfgs fits without dropout)
    seed: int = 0
    classes: list = field(default_factory=list)
    stats: tuple | None = None        # (mean, std) (L, D) of the training tokens: standardize the layers
    optimizer: str = "auto"           # auto: lbfgs for a linear head on a linear combination, else adam
    l2: float = 0.0                   # lbfgs: l2 * ||head weight||^2 added to the mean cross-entropy
    lbfgs_check: int = 25             # lbfgs: iterations between dev checks


def build_model(setting: str, cfg: ProbeConfig, n_layers: int, dim: int) -> tuple[nn.Module, str]:
    """(model, batch mode) for one setting."""
    combiner = make_combiner(setting, n_layers, dim, seed=cfg.seed)
    if cfg.stats is not None:
        combiner = Standardized(combiner, *cfg.stats)
    n = len(cfg.classes)
    if cfg.task == "token":
        return TokenTagger(combiner, dim, n, cfg.dropout), "tokens"
    if cfg.classifier == "bilstm":
        return SentenceBiLSTM(combiner, dim, n, hidden=cfg.hidden // 2, dropout=cfg.dropout), "padded"
    if cfg.classifier == "linear":
        return SentenceLinear(combiner, dim, n, cfg.dropout), ("pooled" if combiner.linear else "padded")
    return SentenceMLP(combiner, dim, n, cfg.hidden, cfg.dropout), ("pooled" if combiner.linear else "padded")


def resolve_optimizer(model: nn.Module, cfg: ProbeConfig) -> str:
    """auto -> lbfgs for a linear head (token tagger, sentence linear) on a linear combination (single layers,
    trainable and frozen mixes): a logistic regression, fitted to convergence; adam otherwise."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")
    if cfg.optimizer != "auto":
        return cfg.optimizer
    return "lbfgs" if isinstance(model, LinearHead) and model.combiner.linear else "adam"


@torch.no_grad()
def predict(model: nn.Module, split: Split, mode: str, batch_size: int = 256) -> np.ndarray:
    model.eval()
    preds = []
    for x, mask, _ in batches(split, mode, batch_size, np.arange(n_rows(split, mode))):
        logits = model(x, mask)
        preds.append(logits.reshape(-1, logits.shape[-1]).argmax(-1))
    return torch.cat(preds).numpy() if preds else np.zeros(0, np.int64)


class _Best:
    """The model state with the best dev accuracy so far (the last one without dev)."""

    def __init__(self, model: nn.Module, dev: Split | None, mode: str):
        self.model, self.dev, self.mode = model, dev, mode
        self.acc, self.state, self.at = -math.inf, None, 0

    def check(self, at: int) -> float | None:
        if self.dev is None:
            self.at = at
            return None
        acc = accuracy(self.dev.targets.numpy(), predict(self.model, self.dev, self.mode))
        if acc > self.acc:
            self.acc, self.at = acc, at
            self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return acc

    def restore(self) -> int:
        if self.state is not None:
            self.model.load_state_dict(self.state)
        return self.at


def _fit_adam(model, params, mode, cfg, train, best, rng, log, setting) -> None:
    """Minibatch Adam for cfg.epochs epochs, dropout on, dev accuracy checked after each."""
    opt = torch.optim.Adam(params, lr=cfg.lr)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        total, count = 0.0, 0
        for x, mask, y in batches(train, mode, cfg.batch_size, rng.permutation(n_rows(train, mode))):
            logits = model(x, mask)
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + float(loss.detach()) * len(y), count + len(y)
        acc = best.check(epoch)
        if log:
            log(f"  {setting} epoch {epoch}: train loss {total / max(count, 1):.4f}"
                + (f", dev acc {acc:.4f}" if acc is not None else ""))


def _fit_lbfgs(model, params, mode, cfg, train, best, log, setting, chunk: int = 8192) -> int:
    """Full-batch L-BFGS (strong Wolfe line search) on mean cross-entropy + l2 * ||head weight||^2, no dropout,
    the gradient accumulated over chunks of `chunk` rows (memory bounded); dev accuracy checked every
    cfg.lbfgs_check iterations, until converged or cfg.epochs checks. Returns the iterations run."""
    model.eval()                                     # no dropout: the objective is deterministic
    opt = torch.optim.LBFGS(params, lr=1, max_iter=cfg.lbfgs_check, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-7, tolerance_change=1e-10)
    n, head = len(train.targets), model.out.weight
    rows = train.tokens if mode == "tokens" else train.pooled       # (N, L, D): chunks are views, not copies
    chunks = [(rows[a:a + chunk].unsqueeze(2), train.targets[a:a + chunk]) for a in range(0, len(rows), chunk)]

    def closure():
        opt.zero_grad()
        total = 0.0
        for x, y in chunks:
            logits = model(x, torch.ones(len(y), 1, dtype=torch.bool)).reshape(len(y), -1)
            loss = nn.functional.cross_entropy(logits, y, reduction="sum") / n
            loss.backward()
            total += float(loss.detach())
        if cfg.l2:
            reg = cfg.l2 * (head * head).sum()
            reg.backward()
            total += float(reg)
        return torch.tensor(total)

    iterations = 0
    for _ in range(cfg.epochs):
        loss = float(opt.step(closure))
        ran = opt.state[params[0]]["n_iter"] - iterations
        iterations += ran
        acc = best.check(iterations)
        if log:
            log(f"  {setting} lbfgs iteration {iterations}: train loss {loss:.4f}"
                + (f", dev acc {acc:.4f}" if acc is not None else ""))
        if ran < cfg.lbfgs_check:                    # converged before the iteration limit of this step
            break
    return iterations


def logistic_regression_accuracy(train: Split, test: Split, layer: int, stats) -> float:
    """A reference for the linear probes: test accuracy of a plain multinomial logistic regression on one
    standardized layer of the token vectors (stats: the (mean, std) per layer), fitted to convergence by
    float64 full-batch L-BFGS, no penalty."""
    mean, std = (t[layer].double() for t in stats)
    x = (train.tokens[:, layer].double() - mean) / std
    w = torch.zeros(x.shape[1], int(train.targets.max()) + 1, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(w.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=2000, tolerance_grad=1e-10, tolerance_change=1e-14, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, train.targets)
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        pred = (((test.tokens[:, layer].double() - mean) / std) @ w + b).argmax(1)
    return float((pred == test.targets).double().mean())


def train_setting(setting: str, cfg: ProbeConfig, train: Split, dev: Split | None, test: Split | None,
                  n_layers: int, dim: int, log=None) -> dict:
    """Train one setting; returns scores per split, the optimizer, the best epoch (lbfgs: iteration), seconds
    and (mixes) layer weights. With dev, the state with the best dev accuracy is kept, else the last."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    model, mode = build_model(setting, cfg, n_layers, dim)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = resolve_optimizer(model, cfg)
    t0 = time.perf_counter()
    best = _Best(model, dev, mode)
    if optimizer == "lbfgs":
        if not isinstance(model, LinearHead):
            raise ValueError("the lbfgs optimizer fits linear heads: --task token or --classifier linear")
        if mode not in ("tokens", "pooled"):
            raise ValueError(f"the lbfgs optimizer needs a linear layer combination, not {setting!r}")
        epochs = _fit_lbfgs(model, params, mode, cfg, train, best, log, setting)
    else:
        _fit_adam(model, params, mode, cfg, train, best, rng, log, setting)
        epochs = cfg.epochs
    best_epoch = best.restore()
    result = {"setting": setting, "classifier": cfg.classifier if cfg.task == "sentence" else "linear",
              "optimizer": optimizer, "best_epoch": best_epoch, "epochs": epochs,
              "trainable_parameters": sum(p.numel() for p in params)}
    for split in (train, dev, test):
        if split is not None:
            result[split.name] = scores(split.targets.numpy(), predict(model, split, mode))
    result["seconds"] = round(time.perf_counter() - t0, 2)
    comb = model.combiner.combiner if isinstance(model.combiner, Standardized) else model.combiner
    if hasattr(comb, "layer_weights"):
        result["layer_weights"] = [round(w, 4) for w in comb.layer_weights()]
        result["gamma"] = round(float(comb.mix.gamma.detach()), 4)
    return result
