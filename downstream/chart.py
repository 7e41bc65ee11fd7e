"""The probe's chart: accuracy and macro-F1 (in %) per setting as a PNG bar chart (OUT/chart.png).

Drawn with matplotlib (error bars: std over seeds) if it is installed, else a plain Pillow rendering.
"""
from __future__ import annotations

import math

import numpy as np


def bar_chart(rows: list[dict], png_path: str, title: str = "", software: str | None = None) -> None:
    """Accuracy and macro-F1 per setting (test split if any, else dev, else train) as a PNG bar chart; `software`:
    its "Software" text chunk (matplotlib's name otherwise)."""
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
    fig.savefig(png_path, dpi=100, bbox_inches="tight", format="png",    # the name may be a temporary one
                metadata={"Software": software} if software else None)
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
    img.save(png_path, format="PNG")
