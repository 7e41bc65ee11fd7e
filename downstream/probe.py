"""Probing the vectors: train and evaluate a classifier on the pipeline's output, per layer setting.

Tasks and classifiers:
  sentence / mlp     combine layers per token -> mean over the sentence's tokens -> MLP (one hidden layer)
  sentence / bilstm  combine layers per token -> BiLSTM -> max over tokens -> linear
  sentence / linear  combine layers per token -> mean over the sentence's tokens -> linear
  token              combine layers per token -> linear tagger
Settings (downstream.combine): layer0 (non-contextual), layer1, layer2, ..., and the mixes trainable,
frozen, learned. For linear settings (single layers, scalar mixes) with the mlp classifier, sentences
are mean-pooled per layer once and mixed after pooling (identical result: both are linear).
Training, cross-entropy: a linear head (token tagger, sentence linear) on a linear combination is a logistic
regression, fitted by full-batch L-BFGS to convergence (no dropout; optional l2 on the head's weights): minibatch
Adam with input dropout 0.3 for 20 epochs, the earlier default, under-fit it (docs/decisions/probe-linear-fit.md).
Everything else: Adam. With a dev split the state with the best dev accuracy (per epoch; L-BFGS: every 25
iterations) is kept and its test scores reported, else the last. Metrics: accuracy and macro-F1 (mean of per-class F1 over the
classes present in the gold labels or predictions).
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from downstream.combine import SelectLayer, make_combiner


# ---------------------------------------------------------------- metrics
def accuracy(gold: Sequence[int], pred: Sequence[int]) -> float:
    gold, pred = np.asarray(gold), np.asarray(pred)
    return float((gold == pred).mean()) if len(gold) else float("nan")


def macro_f1(gold: Sequence[int], pred: Sequence[int]) -> float:
    gold, pred = np.asarray(gold), np.asarray(pred)
    classes = np.union1d(gold, pred)
    f1s = []
    for c in classes:
        tp = int(((pred == c) & (gold == c)).sum())
        fp = int(((pred == c) & (gold != c)).sum())
        fn = int(((pred != c) & (gold == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(f1s)) if f1s else float("nan")


def scores(gold, pred) -> dict:
    return {"accuracy": accuracy(gold, pred), "macro_f1": macro_f1(gold, pred), "n": int(len(gold))}


# ---------------------------------------------------------------- models
class Standardized(nn.Module):
    """z-score each layer's features with training-set token statistics, then combine. Affine per
    feature, so it commutes with mean pooling (the pooled path stays exact)."""

    def __init__(self, combiner: nn.Module, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.combiner = combiner
        self.linear = combiner.linear
        self.register_buffer("mean", mean[:, None, :].clone())    # (L, 1, D)
        self.register_buffer("std", std[:, None, :].clone())

    def forward(self, layers: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.combiner, SelectLayer):      # the same result, one layer's work
            k = self.combiner.index
            return (layers[:, k] - self.mean[k]) / self.std[k]
        return self.combiner((layers - self.mean) / self.std, mask)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp_min(1)


class SentenceMLP(nn.Module):
    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, hidden: int = 256, dropout: float = 0.3):
        super().__init__()
        self.combiner = combiner
        self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, n_classes))

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.mlp(_masked_mean(self.combiner(layers, mask), mask))


class SentenceLinear(nn.Module):
    """combine -> mean over the sentence's tokens -> linear: a logistic regression on the pooled mix."""

    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, dropout: float = 0.0):
        super().__init__()
        self.combiner = combiner
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, n_classes)

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(_masked_mean(self.combiner(layers, mask), mask)))


class SentenceBiLSTM(nn.Module):
    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, hidden: int = 128, dropout: float = 0.3):
        super().__init__()
        self.combiner = combiner
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, n_classes)

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.combiner(layers, mask))
        lengths = mask.sum(1).clamp_min(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
        h = h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
        return self.out(self.drop(h))


class TokenTagger(nn.Module):
    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, dropout: float = 0.3):
        super().__init__()
        self.combiner = combiner
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, n_classes)

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.combiner(layers, mask)))   # (B, T, C)


# ---------------------------------------------------------------- data
@dataclass
class Split:
    """Records of one split (dicts with "layers" (L, T, D) float32 and an int "label" or "tags")."""
    name: str
    records: list
    pooled: torch.Tensor | None = None     # (N, L, D): per-layer mean over tokens, for linear settings
    tokens: torch.Tensor | None = None     # (Ntok, L, D): all tokens, for the tagger
    targets: torch.Tensor | None = None    # (N,) or (Ntok,)

    def token_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer and feature mean and std over all tokens: (L, D) each."""
        n, s1, s2 = 0, 0.0, 0.0
        for r in self.records:
            x = r["layers"].astype(np.float64)
            n, s1, s2 = n + x.shape[1], s1 + x.sum(1), s2 + (x * x).sum(1)
        mean = s1 / max(n, 1)
        std = np.sqrt(np.maximum(s2 / max(n, 1) - mean * mean, 0)) + 1e-5
        return torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)

    def prepare(self, task: str) -> "Split":
        if task == "sentence":
            self.pooled = torch.stack([torch.from_numpy(r["layers"].mean(1)) if r["layers"].shape[1]
                                       else torch.zeros(r["layers"].shape[0], r["layers"].shape[2]) for r in self.records])
            self.targets = torch.tensor([r["label"] for r in self.records], dtype=torch.int64)
        else:
            self.tokens = torch.from_numpy(np.concatenate([r["layers"].transpose(1, 0, 2) for r in self.records]))
            self.targets = torch.tensor([t for r in self.records for t in r["tags"]], dtype=torch.int64)
        return self


def _padded(records: list) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(r["layers"].shape[1] for r in records)
    L, _, D = records[0]["layers"].shape
    x = torch.zeros(len(records), L, max(T, 1), D)
    mask = torch.zeros(len(records), max(T, 1), dtype=torch.bool)
    for b, r in enumerate(records):
        n = r["layers"].shape[1]
        x[b, :, :n] = torch.from_numpy(r["layers"])
        mask[b, :n] = True
    return x, mask


def _batches(split: Split, mode: str, batch_size: int, order: np.ndarray):
    """(layers, mask, targets) batches in `order`. mode: pooled | padded | tokens."""
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        if mode == "pooled":
            x = split.pooled[idx].unsqueeze(2)                   # (B, L, 1, D)
            yield x, torch.ones(len(idx), 1, dtype=torch.bool), split.targets[idx]
        elif mode == "tokens":
            x = split.tokens[idx].unsqueeze(2)                   # (B, L, 1, D)
            yield x, torch.ones(len(idx), 1, dtype=torch.bool), split.targets[idx]
        else:
            recs = [split.records[i] for i in idx]
            x, mask = _padded(recs)
            yield x, mask, torch.tensor([r["label"] for r in recs], dtype=torch.int64)


def _size(split: Split, mode: str) -> int:
    return len(split.targets) if mode == "tokens" else len(split.records)


# ---------------------------------------------------------------- training
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
    return "lbfgs" if isinstance(model, (TokenTagger, SentenceLinear)) and model.combiner.linear else "adam"


@torch.no_grad()
def predict(model: nn.Module, split: Split, mode: str, batch_size: int = 256) -> np.ndarray:
    model.eval()
    preds = []
    for x, mask, _ in _batches(split, mode, batch_size, np.arange(_size(split, mode))):
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
        for x, mask, y in _batches(train, mode, cfg.batch_size, rng.permutation(_size(train, mode))):
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
        if not isinstance(model, (TokenTagger, SentenceLinear)):
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


def expand_settings(settings: Sequence[str], combine: Sequence[str], n_layers: int) -> list[str]:
    """'layers' -> layer0..layer{L-1}; 'mix' -> mix-<c> for each --combine c; others kept."""
    out = []
    for s in settings:
        s = s.strip()
        if s == "layers":
            out += [f"layer{k}" for k in range(n_layers)]
        elif s == "mix":
            out += [f"mix-{c}" for c in combine]
        elif s:
            out.append(s if s.startswith(("layer", "mix-")) else f"mix-{s}")
    for s in out:
        make_combiner(s, n_layers, 2)   # validates
    return list(dict.fromkeys(out))


def summarize(runs: list[dict]) -> list[dict]:
    """Runs of several seeds per setting -> one row per setting: mean and std of each score."""
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == setting]
        row = {"setting": setting, "classifier": rs[0]["classifier"], "seeds": len(rs),
               "seconds": round(sum(r["seconds"] for r in rs), 2),
               "best_epochs": [r["best_epoch"] for r in rs]}
        for split in ("train", "dev", "test"):
            if split in rs[0]:
                for m in ("accuracy", "macro_f1"):
                    v = np.array([r[split][m] for r in rs])
                    row[f"{split}_{m}"] = float(v.mean())
                    row[f"{split}_{m}_std"] = float(v.std()) if len(v) > 1 else 0.0
        if "layer_weights" in rs[0]:
            row["layer_weights"] = np.mean([r["layer_weights"] for r in rs], 0).round(3).tolist()
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], baseline: dict | None = None) -> str:
    splits = [s for s in ("dev", "test") if f"{s}_accuracy" in rows[0]] or ["train"]
    seeds = rows[0]["seeds"]
    fmt = (lambda r, k: f"{100 * r[k]:.1f} ± {100 * r[k + '_std']:.1f}") if seeds > 1 else (lambda r, k: f"{100 * r[k]:.1f}")
    head = ["setting", "classifier"] + [f"{s} {m}" for s in splits for m in ("acc", "macro-F1")] + ["mix weights (softmax)", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        w = ", ".join(f"{x:.2f}" for x in r["layer_weights"]) if "layer_weights" in r else ""
        lines.append("| " + " | ".join([r["setting"], r["classifier"]] + [fmt(r, f"{s}_{m}") for s in splits
                                        for m in ("accuracy", "macro_f1")] + [w, f"{r['seconds']:.1f}"]) + " |")
    if baseline:
        lines.append("| majority class | - | " + " | ".join(
            f"{100 * baseline[s][m]:.1f}" for s in splits for m in ("accuracy", "macro_f1")) + " |  |  |")
    note = f"\nScores in %, mean ± std over {seeds} seeds." if seeds > 1 else "\nScores in %."
    return "\n".join(lines) + "\n" + note + "\n"


def bar_chart(rows: list[dict], png_path: str, title: str = "") -> None:
    """Accuracy and macro-F1 per setting (test split if any, else dev, else train) as a PNG bar chart."""
    split = next(s for s in ("test", "dev", "train") if f"{s}_accuracy" in rows[0])
    names = [r["setting"] for r in rows]
    acc = [100 * r[f"{split}_accuracy"] for r in rows]
    f1 = [100 * r[f"{split}_macro_f1"] for r in rows]
    err = [[100 * r.get(f"{split}_{m}_std", 0.0) for r in rows] for m in ("accuracy", "macro_f1")]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _bars_pillow(names, acc, f1, png_path, f"{title} ({split})")
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4.5))
    x = np.arange(len(names))
    seeds = rows[0].get("seeds", 1)
    b1 = ax.bar(x - 0.2, acc, 0.4, label="accuracy", yerr=err[0] if seeds > 1 else None, capsize=3)
    b2 = ax.bar(x + 0.2, f1, 0.4, label="macro-F1", yerr=err[1] if seeds > 1 else None, capsize=3)
    ax.bar_label(b1, fmt="%.1f", fontsize=8)
    ax.bar_label(b2, fmt="%.1f", fontsize=8)
    ax.set_xticks(x, names, rotation=20)
    lo = max(0.0, min(acc + f1) - 10)
    ax.set_ylim(lo, 100)
    ax.set_ylabel(f"{split} score (%)")
    ax.set_title(title + (f" (mean ± std over {seeds} seeds)" if seeds > 1 else ""))
    ax.legend(loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(png_path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _bars_pillow(names, acc, f1, png_path, title, size=(900, 480)) -> None:
    from PIL import Image, ImageDraw
    W, H = size
    left, right, top, bottom = 50, 20, 30, 60
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    lo = max(0.0, min(acc + f1) - 10)
    y = lambda v: top + (H - top - bottom) * (1 - (v - lo) / (100 - lo))
    d.text((left, 8), title, fill="black")
    d.line([(left, top), (left, H - bottom), (W - right, H - bottom)], fill="black")
    for t in range(int(math.ceil(lo / 10) * 10), 101, 10):
        d.text((5, y(t) - 6), str(t), fill="black")
    slot = (W - left - right) / max(1, len(names))
    for i, n in enumerate(names):
        x0 = left + i * slot + slot * 0.1
        for j, (v, c) in enumerate(((acc[i], (31, 119, 180)), (f1[i], (255, 127, 14)))):
            xa = x0 + j * slot * 0.4
            d.rectangle([xa, y(v), xa + slot * 0.38, H - bottom], fill=c)
            d.text((xa, y(v) - 12), f"{v:.1f}", fill="black")
        d.text((x0, H - bottom + 8), n, fill="black")
    d.text((W - 200, 8), "blue: accuracy  orange: macro-F1", fill="black")
    img.save(png_path)


def write_report(out_dir: str, rows: list[dict], runs: list[dict], meta: dict, baseline: dict | None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    table = markdown_table(rows, baseline)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table)
    result = {"meta": meta, "summary": rows, "runs": runs, "majority_baseline": baseline}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    title = f"{meta.get('task', '')} probe, {meta.get('classifier', '')}"
    bar_chart(rows, os.path.join(out_dir, "chart.png"), title)
    return result


def majority_baseline(train: Split, others: Sequence[Split | None]) -> dict:
    majority = int(np.bincount(train.targets.numpy()).argmax())
    out = {}
    for s in (train, *others):
        if s is not None:
            out[s.name] = scores(s.targets.numpy(), np.full(len(s.targets), majority))
    return out
