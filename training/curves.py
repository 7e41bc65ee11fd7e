"""Draw curves.csv (written by training/train.py) as a PNG: perplexity (log scale) against training step.

Uses matplotlib when installed, else Pillow (installed with Apache Beam); raises ImportError if neither is.
Lines: train mean perplexity, valid forward / backward / mean perplexity.
"""
from __future__ import annotations

import csv
import math


def _series(csv_path: str) -> dict[str, tuple[list[float], list[float]]]:
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        keys = [("train mean", "ppl_mean")] if r["split"] == "train" else \
            [(f"{r['split']} fwd", "ppl_fwd"), (f"{r['split']} bwd", "ppl_bwd"), (f"{r['split']} mean", "ppl_mean")]
        for label, col in keys:
            xs, ys = out.setdefault(label, ([], []))
            xs.append(float(r["step"]))
            ys.append(float(r[col]))
    return out


def has_curves(csv_path: str) -> bool:
    """Whether curves.csv holds a point to draw."""
    return bool(_series(csv_path))


def plot_curves(csv_path: str, png_path: str) -> None:
    series = _series(csv_path)
    if not series:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_pillow(series, png_path)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, marker="o" if not label.startswith("train") else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("perplexity")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.savefig(png_path, dpi=100, bbox_inches="tight", format="png")     # the name may be a temporary one
    plt.close(fig)


COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def _plot_pillow(series, png_path: str, size=(800, 500)) -> None:
    from PIL import Image, ImageDraw
    W, H = size
    left, right, top, bottom = 70, 20, 20, 50
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    xs_all = [x for xs, _ in series.values() for x in xs]
    ys_all = [math.log(max(y, 1e-9)) for _, ys in series.values() for y in ys]
    x0, x1 = min(xs_all), max(max(xs_all), min(xs_all) + 1)
    y0, y1 = min(ys_all), max(max(ys_all), min(ys_all) + 1e-3)

    def px(x, y):
        return (left + (x - x0) / (x1 - x0) * (W - left - right),
                H - bottom - (math.log(max(y, 1e-9)) - y0) / (y1 - y0) * (H - top - bottom))

    d.rectangle([left, top, W - right, H - bottom], outline="black")
    for k in range(5):   # y ticks: perplexity on a log scale
        v = math.exp(y0 + (y1 - y0) * k / 4)
        _, yy = px(x0, v)
        d.line([left - 4, yy, left, yy], fill="black")
        d.text((4, yy - 6), f"{v:.0f}", fill="black")
    for k in range(5):
        v = x0 + (x1 - x0) * k / 4
        xx, _ = px(v, math.exp(y0))
        d.line([xx, H - bottom, xx, H - bottom + 4], fill="black")
        d.text((xx - 15, H - bottom + 8), f"{v:.0f}", fill="black")
    d.text((W // 2 - 15, H - 20), "step", fill="black")
    d.text((4, 4), "perplexity (log scale)", fill="black")
    for i, (label, (xs, ys)) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        pts = [px(x, y) for x, y in zip(xs, ys)]
        if len(pts) > 1:
            d.line(pts, fill=color, width=2)
        for p in pts if not label.startswith("train") else []:
            d.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=color)
        d.text((W - right - 150, top + 8 + 14 * i), label, fill=color)
    img.save(png_path, format="PNG")
