"""The probe's results: one row per setting over its seeds, the Markdown table, and the report files.

A run (train_setting's dict) holds per split {"accuracy", "macro_f1", "n"} (fractions) and "seconds";
a row holds <split>_<metric> and <split>_<metric>_std (mean and std over seeds). write_report writes
OUT/table.md (scores in %), OUT/results.json ({meta, summary: rows, runs, majority_baseline}) and
OUT/chart.png.
"""
from __future__ import annotations

import json
import os

import numpy as np

from elmo_pipeline.downstream.chart import bar_chart
from elmo_pipeline.fsio import atomic_write, only_a_file, replacing, url_fs


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


REPORT_FILES = ("table.md", "results.json", "chart.png")


def check_report_folder(out_dir: str) -> None:
    """FileExistsError unless `out_dir` is a folder or nothing, and each report file in it nothing or a regular file
    (fsio.only_a_file): what write_report would refuse, found before the probe trains."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is no folder: it is left as it is; name another --out")
    for name in REPORT_FILES:
        only_a_file(os.path.join(out_dir, name))


def write_report(out_dir: str, rows: list[dict], runs: list[dict], meta: dict, baseline: dict | None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    table = markdown_table(rows, baseline)
    check_report_folder(out_dir)     # each file whole, only over nothing or a regular file (fsio.replacing files_only)
    fs = url_fs(out_dir)[0]
    atomic_write(fs, os.path.join(out_dir, "table.md"), table.encode("utf-8"), files_only=True)
    result = {"meta": meta, "summary": rows, "runs": runs, "majority_baseline": baseline}
    atomic_write(fs, os.path.join(out_dir, "results.json"), json.dumps(result, indent=1).encode(), files_only=True)
    title = f"{meta.get('task', '')} probe, {meta.get('classifier', '')}"
    with replacing(os.path.join(out_dir, "chart.png"), files_only=True) as tmp:
        bar_chart(rows, tmp, title)
    return result
