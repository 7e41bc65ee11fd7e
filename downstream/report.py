"""The probe's results: one row per setting over its seeds, the Markdown table, and the report files.

A run (train_setting's dict) holds per split {"accuracy", "macro_f1", "n"} (fractions) and "seconds";
a row holds <split>_<metric> and <split>_<metric>_std (mean and std over seeds). write_report writes
OUT/table.md (scores in %), OUT/results.json ({meta, summary: rows, runs, majority_baseline, written_by}) and
OUT/chart.png, each marked as the probe's (WRITTEN_BY): a rerun replaces them, never a user's files of those names.
"""
from __future__ import annotations

import json
import os

import numpy as np

from elmo_pipeline.downstream.chart import bar_chart
from elmo_pipeline.fsio import atomic_write, only_a_file, redact, replacing, url_fs


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
# What marks each report file as the probe's, so that a rerun replaces its own files and never a user's: table.md's
# last line, results.json's "written_by", chart.png's "Software" text chunk.
WRITTEN_BY = "elmo-pipeline probe"
TABLE_MARK = f"<!-- written by {WRITTEN_BY} -->"
MARK_BYTES = 1 << 20        # the most of a report file read to find its mark (results.json: whole, up to 64 MiB)
RESULTS_BYTES = 64 << 20


def check_report_folder(out_dir: str) -> None:
    """FileExistsError unless `out_dir` is a folder or nothing, and each report file in it nothing or a regular file
    (fsio.only_a_file) that the probe wrote (its mark: written_by): what write_report would refuse, found before
    the probe trains. A user's table.md, results.json or chart.png is left as it is. A URL is refused: the report
    is written locally only."""
    if "://" in out_dir:
        raise FileExistsError(f"{redact(out_dir)}: a URL, not a local folder: the report is written locally only")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is no folder: it is left as it is; name another --out")
    for name in REPORT_FILES:
        path = os.path.join(out_dir, name)
        only_a_file(path)
        if os.path.lexists(path) and not written_by_probe(path):
            raise FileExistsError(f"{path} exists and is not a file the probe wrote: it is left as it is; move it "
                                  "away or name another --out")


def written_by_probe(path: str) -> bool:
    """Whether the regular file at `path` (a report file's name) carries the probe's mark; any failure to read it,
    or a file too large to be one: not the probe's."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            if name == "results.json":
                data = f.read(RESULTS_BYTES + 1)
                return len(data) <= RESULTS_BYTES and json.loads(data).get("written_by") == WRITTEN_BY
            if name == "table.md":
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                return f.read().decode("utf-8", "replace").rstrip().endswith(TABLE_MARK)
            from PIL import Image
            with Image.open(f, formats=["PNG"]) as image:
                return image.info.get("Software") == WRITTEN_BY
    except Exception:  # noqa: BLE001 - unreadable, damaged, another kind of file: not the probe's
        return False


def write_report(out_dir: str, rows: list[dict], runs: list[dict], meta: dict, baseline: dict | None) -> dict:
    check_report_folder(out_dir)     # each file whole, only over nothing or the probe's own (fsio.replacing files_only)
    os.makedirs(out_dir, exist_ok=True)
    table = markdown_table(rows, baseline) + "\n" + TABLE_MARK + "\n"
    fs = url_fs(out_dir)[0]
    atomic_write(fs, os.path.join(out_dir, "table.md"), table.encode("utf-8"), files_only=True)
    result = {"meta": meta, "summary": rows, "runs": runs, "majority_baseline": baseline, "written_by": WRITTEN_BY}
    atomic_write(fs, os.path.join(out_dir, "results.json"), json.dumps(result, indent=1).encode(), files_only=True)
    title = f"{meta.get('task', '')} probe, {meta.get('classifier', '')}"
    with replacing(os.path.join(out_dir, "chart.png"), files_only=True) as tmp:
        bar_chart(rows, tmp, title, software=WRITTEN_BY)
    return result
