"""The run report: <out>/report.html, one self-contained page (inline SVG charts, no script, no fetch).
No Beam import.

Finalize builds it in the launching process (output/finalize.py) from what the run staged: the
manifest being written (model, counts, dead letters by reason), the kept commit records (sentence-length
histograms per shard: resumed shards included) and the workers' run statistics (output/stats.py:
tokens embedded per wall-clock second, padding per batch-length bucket, seconds per stage).

report_data() gathers the numbers (tests read them), render() lays out the page; the SVG chart functions
(columns, horizontal bars, a line) are small and dependency-free.
"""
from __future__ import annotations

import html
import math

from elmo_pipeline.output.stats import STAGES, merge_stats
from elmo_pipeline.formats.metrics import UPSERT_COUNTS

MAX_POINTS = 120            # tokens/s over time: at most this many points (wider time bins beyond)
MAX_BINS = 40               # sentence-length histogram bins (longer than the 99th percentile: one last bin)


# ---------------------------------------------------------------- the numbers
def _nice(x: float) -> float:
    """The smallest 1, 2 or 5 x 10^k >= x."""
    if x <= 0:
        return 1
    e = 10 ** math.floor(math.log10(x))
    return next(m * e for m in (1, 2, 5, 10) if m * e >= x)


def timeline(tokens_at: dict[int, int]) -> dict:
    """Tokens/s over time from {unix second: tokens}: bins of `width` seconds (at most MAX_POINTS), x in
    seconds since the first embedded batch, y the bin's tokens / width."""
    if not tokens_at:
        return {"width": 1, "x": [], "tokens_per_s": [], "span_s": 0, "tokens": 0}
    t0, t1 = min(tokens_at), max(tokens_at)
    span = t1 - t0 + 1
    width = max(1, math.ceil(span / MAX_POINTS))
    bins = [0] * math.ceil(span / width)
    for t, n in tokens_at.items():
        bins[(t - t0) // width] += n
    return {"width": width, "x": [i * width for i in range(len(bins))], "tokens_per_s": [b / width for b in bins],
            "span_s": span, "tokens": round(sum(bins))}


def length_histogram(lengths: dict[int, int]) -> dict:
    """Sentence lengths {tokens: sentences} in at most MAX_BINS bins of a round width; sentences longer than
    the 99th percentile (when the tail is long) are one last bin."""
    if not lengths:
        return {"labels": [], "counts": [], "sentences": 0}
    total = sum(lengths.values())
    ordered = sorted(lengths.items())
    acc, p50, p99 = 0, None, None
    for n, c in ordered:
        acc += c
        if p50 is None and acc >= 0.5 * total:
            p50 = n
        if p99 is None and acc >= 0.99 * total:
            p99 = n
    longest = ordered[-1][0]
    upper = p99 if longest > 2 * p99 else longest
    width = max(1, int(_nice(upper / MAX_BINS)))
    nbins = upper // width + 1
    counts, overflow = [0] * nbins, 0
    for n, c in ordered:
        if n > upper:
            overflow += c
        else:
            counts[n // width] += c
    labels = [str(i * width) if width == 1 else f"{i * width}-{i * width + width - 1}" for i in range(nbins)]
    if overflow:
        labels.append(f"{upper + 1}-{longest}")
        counts.append(overflow)
    mean = sum(n * c for n, c in ordered) / total
    return {"labels": labels, "counts": counts, "sentences": total, "mean": mean, "median": p50, "p99": p99,
            "max": longest, "width": width}


def report_data(manifest: dict, records: list[dict], stats_parts: list[dict], run_seconds: float | None = None) -> dict:
    """Everything the page shows, as plain numbers."""
    stats = merge_stats(stats_parts)
    counts = manifest.get("counts", {})
    lengths: dict[int, int] = {}
    for r in records:
        for k, v in r.get("lengths", {}).items():
            lengths[int(k)] = lengths.get(int(k), 0) + v
    pad = stats["padding"]
    real, slots = sum(v[1] for v in pad.values()), sum(v[2] for v in pad.values())
    tl = timeline(stats["tokens_at"])
    span = stats["span"][1] - stats["span"][0] if stats["span"] else 0.0
    embed_s = stats["seconds"].get("embed", 0.0)
    model = manifest.get("model", {})
    return {
        "summary": {
            "model": model.get("name", "?"), "run_key": manifest.get("run", {}).get("key", ""),
            "inputs": len(manifest.get("inputs", [])), "documents": counts.get("documents", 0),
            "sentences": counts.get("sentences", 0), "sentences_written": counts.get("sentences_written", 0),
            "tokens_written": counts.get("tokens_written", 0), "dead_letters": counts.get("dead_letters", 0),
            "shards": len(manifest.get("shards", [])), "formats": manifest.get("formats", []),
            "resumed_sentences": manifest.get("run", {}).get("resumed_sentences", 0),
            "tokens_embedded": tl["tokens"], "embedding_span_s": span,
            "tokens_per_s": tl["tokens"] / span if span else 0.0,
            "tokens_per_embed_s": tl["tokens"] / embed_s if embed_s else 0.0,
            "run_seconds": run_seconds, "processes": len(stats["hosts"]),
            "upsert": {k[len("documents_"):]: v for k, v in counts.items() if k in UPSERT_COUNTS},
        },
        "timeline": tl,
        "lengths": length_histogram(lengths),
        "padding": {"batches": sum(v[0] for v in pad.values()), "tokens": real, "slots": slots,
                    "fraction": 1 - real / slots if slots else 0.0,
                    "buckets": [{"longest": k, "batches": v[0], "tokens": v[1], "slots": v[2],
                                 "fraction": 1 - v[1] / v[2] if v[2] else 0.0} for k, v in sorted(pad.items())]},
        "stages": {k: stats["seconds"].get(k, 0.0) for k in STAGES},
        "dead_letters": dict(sorted(counts.get("dead_letters_by_reason", {}).items(), key=lambda kv: -kv[1])),
    }


# ---------------------------------------------------------------- SVG charts
W, H = 760, 260
PAD = {"left": 64, "right": 16, "top": 14, "bottom": 46}
COLOR = "#3b6ea8"
_esc = html.escape


def _num(v: float) -> str:
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.1f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{int(v):,}"


def _ticks(top: float, n: int = 4) -> list[float]:
    """0, step, 2 step, ... up to the first tick >= top (a round step, about n of them)."""
    step = _nice(top / n) if top > 0 else 1
    return [step * i for i in range(max(1, math.ceil(top / step - 1e-9)) + 1)]


def _axes(ymax: float, ylabel: str, xlabel: str) -> tuple[list[str], float]:
    """Y grid, ticks and axis labels; returns the parts and the y scale's top."""
    ticks = _ticks(ymax)
    top = ticks[-1]
    x0, x1, y0, y1 = PAD["left"], W - PAD["right"], H - PAD["bottom"], PAD["top"]
    parts = []
    for t in ticks:
        y = y0 - (y0 - y1) * t / top
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{_num(t)}</text>')
    parts.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="#444"/>')
    parts.append(f'<text x="{(x0 + x1) / 2}" y="{H - 6}" text-anchor="middle">{_esc(xlabel)}</text>')
    parts.append(f'<text transform="translate(14 {(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">'
                 f'{_esc(ylabel)}</text>')
    return parts, top


def _svg(parts: list[str], height: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" '
            f'font-family="sans-serif" font-size="11" fill="#222">' + "".join(parts) + "</svg>")


def svg_columns(labels: list[str], values: list[float], ylabel: str, xlabel: str, fmt=_num) -> str:
    """A column chart (histograms): one column per label, a tooltip with its value."""
    parts, top = _axes(max(values, default=0), ylabel, xlabel)
    x0, y0 = PAD["left"], H - PAD["bottom"]
    n = max(1, len(values))
    step = (W - PAD["left"] - PAD["right"]) / n
    every = max(1, math.ceil(n / 16))           # at most ~16 x labels
    for i, (label, v) in enumerate(zip(labels, values)):
        h = (y0 - PAD["top"]) * v / top
        x = x0 + i * step
        parts.append(f'<rect x="{x + step * 0.1:.1f}" y="{y0 - h:.1f}" width="{step * 0.8:.1f}" height="{h:.1f}" '
                     f'fill="{COLOR}"><title>{_esc(label)}: {fmt(v)}</title></rect>')
        if i % every == 0:
            parts.append(f'<text x="{x + step / 2:.1f}" y="{y0 + 14}" text-anchor="middle">{_esc(label)}</text>')
    return _svg(parts)


def svg_hbars(labels: list[str], values: list[float], fmt=_num) -> str:
    """Horizontal bars with their labels on the left and values at their ends (stages, reasons)."""
    row, left, right = 24, 190, 110
    height = PAD["top"] + row * max(1, len(values)) + 6
    vmax = max(values, default=0) or 1
    parts = []
    for i, (label, v) in enumerate(zip(labels, values)):
        y = PAD["top"] + i * row
        w = (W - left - right) * v / vmax
        parts.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{_esc(label)}</text>'
                     f'<rect x="{left}" y="{y + 3}" width="{w:.1f}" height="{row - 8}" fill="{COLOR}">'
                     f'<title>{_esc(label)}: {fmt(v)}</title></rect>'
                     f'<text x="{left + w + 6:.1f}" y="{y + 15}">{fmt(v)}</text>')
    return _svg(parts, height)


def svg_line(xs: list[float], ys: list[float], ylabel: str, xlabel: str) -> str:
    """A line over x (an area under it; dots when there are few points)."""
    parts, top = _axes(max(ys, default=0), ylabel, xlabel)
    x0, x1, y0, y1 = PAD["left"], W - PAD["right"], H - PAD["bottom"], PAD["top"]
    xmax = max(xs[-1] if xs else 1, 1)

    def px(x, y):
        return x0 + (x1 - x0) * x / xmax, y0 - (y0 - y1) * y / top

    for t in (t for t in _ticks(xmax, 6) if float(t).is_integer()):
        x, _ = px(t, 0)
        parts.append(f'<text x="{x:.1f}" y="{y0 + 14}" text-anchor="middle">{_num(t)}</text>')
    pts = [px(x, y) for x, y in zip(xs, ys)]
    if len(pts) > 1:
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        parts.append(f'<polygon points="{pts[0][0]:.1f},{y0} {line} {pts[-1][0]:.1f},{y0}" fill="{COLOR}" '
                     'fill-opacity="0.15"/>')
        parts.append(f'<polyline points="{line}" fill="none" stroke="{COLOR}" stroke-width="2"/>')
    if len(pts) <= 30:
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{COLOR}"/>' for x, y in pts]
    return _svg(parts)


# ---------------------------------------------------------------- the page
CSS = """body{font-family:sans-serif;max-width:800px;margin:24px auto;color:#222;padding:0 12px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;text-align:right;border-bottom:1px solid #eee}
td:first-child,th:first-child{text-align:left}.note{color:#666;font-size:12px}svg{display:block}"""


def _table(rows: list[list], header: list[str] | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, str) else _num(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table>{head}{body}</table>"


def _none(what: str) -> str:
    return f'<p class="note">No {what} (nothing was staged for it by this run).</p>'


def render(d: dict) -> str:
    s, tl, ln, pad = d["summary"], d["timeline"], d["lengths"], d["padding"]
    out = [f"<h1>elmo-pipeline run report</h1><p class=\"note\">model <b>{_esc(str(s['model']))}</b>, run key "
           f"{_esc(s['run_key'])}, {s['inputs']} input file(s), formats {_esc(', '.join(s['formats']))}</p>"]
    rows = [["documents", s["documents"]], ["sentences", s["sentences"]],
            ["sentences written", s["sentences_written"]], ["tokens written", s["tokens_written"]],
            ["dead letters", s["dead_letters"]], ["shards", s["shards"]],
            ["tokens embedded by this run", s["tokens_embedded"]],
            ["embedding wall time, first batch to last (s)", float(s["embedding_span_s"])],
            ["tokens/s over that time", s["tokens_per_s"]],
            ["tokens/s (time inside the model)", s["tokens_per_embed_s"]],
            ["padding", f"{pad['fraction']:.1%}"], ["worker processes", s["processes"]]]
    if s["resumed_sentences"]:
        rows.append(["sentences resumed (committed by an interrupted run)", s["resumed_sentences"]])
    if s["run_seconds"] is not None:
        rows.append(["run wall time until finalize (s)", float(s["run_seconds"])])
    rows += [[f"documents {change} (--iceberg-mode upsert)", n] for change, n in s.get("upsert", {}).items()]
    out.append('<h2 id="summary">Summary</h2>' + _table(rows))

    out.append('<h2 id="tokens-per-second">Tokens/s over time</h2>')
    if tl["x"]:
        out.append(svg_line(tl["x"], tl["tokens_per_s"], "tokens/s", f"seconds since the first batch "
                            f"(bins of {tl['width']} s, all worker processes)"))
        out.append('<p class="note">Tokens embedded in each bin over its width (a batch counts in the seconds it '
                   "took, in proportion); the first and last bins may be partly idle. A resumed run includes its "
                   "interrupted attempt.</p>")
    else:
        out.append(_none("embedded batches"))

    out.append('<h2 id="sentence-lengths">Sentence lengths</h2>')
    if ln["counts"]:
        out.append(svg_columns(ln["labels"], ln["counts"], "sentences", "tokens per sentence"))
        out.append(_table([[f"{ln['sentences']:,} sentences written", f"mean {ln['mean']:.1f}",
                            f"median {ln['median']}", f"99th percentile {ln['p99']}", f"longest {ln['max']}"]]))
    else:
        out.append(_none("sentence lengths"))

    out.append('<h2 id="padding">Padding</h2>')
    if pad["slots"]:
        out.append(f"<p>{pad['fraction']:.1%} of the batches' token slots are padding ({_num(pad['tokens'])} "
                   f"tokens in {_num(pad['slots'])} slots, {_num(pad['batches'])} batches). By the batch's "
                   "longest sentence:</p>")
        b = pad["buckets"]
        out.append(svg_columns([f"<={x['longest']}" for x in b], [100 * x["fraction"] for x in b],
                               "padding %", "longest sentence in the batch (tokens)", fmt=lambda v: f"{v:.1f}%"))
        out.append(_table([[f"<= {x['longest']}", x["batches"], x["tokens"], x["slots"], f"{x['fraction']:.1%}"]
                           for x in b], ["longest sentence", "batches", "tokens", "slots", "padding"]))
    else:
        out.append(_none("batches"))

    out.append('<h2 id="time-per-stage">Time per stage</h2>')
    if any(d["stages"].values()):
        out.append(svg_hbars(list(d["stages"]), list(d["stages"].values()), fmt=lambda v: f"{v:,.2f} s"))
        out.append('<p class="note">Wall seconds inside each stage, summed over worker processes. Shards are '
                   "written on threads beside the model, so write time overlaps embed time.</p>")
    else:
        out.append(_none("stage timings"))

    out.append('<h2 id="dead-letters">Dead letters by reason</h2>')
    if d["dead_letters"]:
        out.append(svg_hbars(list(d["dead_letters"]), list(d["dead_letters"].values())))
    else:
        out.append("<p>None: every sentence was written.</p>")
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>elmo-pipeline run report</title>'
            f"<style>{CSS}</style></head><body>" + "".join(out) + "</body></html>\n")


def build_report(manifest: dict, records: list[dict], stats_parts: list[dict], run_seconds: float | None = None) -> str:
    """The report page of a run (see the module docstring)."""
    return render(report_data(manifest, records, stats_parts, run_seconds))
