"""Scores of a prediction against gold labels, and of the majority-class baseline.

Labels are class indices (ints); token tasks score every token. Scores are fractions in [0, 1]:
accuracy, and macro-F1 (the mean of per-class F1 over the classes present in the gold labels or the
predictions); nan for an empty split.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from elmo_pipeline.downstream.splits import Split


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


def majority_baseline(train: Split, others: Sequence[Split | None]) -> dict:
    """{split name: scores} of always predicting train's most frequent class."""
    majority = int(np.bincount(train.targets.numpy()).argmax())
    out = {}
    for s in (train, *others):
        if s is not None:
            out[s.name] = scores(s.targets.numpy(), np.full(len(s.targets), majority))
    return out
