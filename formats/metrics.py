"""<out>/metrics.prom: a run's counts and stage times in the Prometheus text exposition format (0.0.4), the
format node_exporter's textfile collector reads (and Prometheus/OpenMetrics scrapers parse). No Beam import.

The counts are manifest.json's `counts` (the same numbers, by construction: metrics_text() reads them from
the manifest); stage seconds are those of the run report (output/stats.py). Every sample carries the
label output="<--output>" (redacted: fsio/redact.py), so one collector folder can hold the files of many outputs (partitions).
"""
from __future__ import annotations

import math

from elmo_pipeline.fsio import redact

PREFIX = "elmo_pipeline_"
# manifest counts key -> help; each becomes elmo_pipeline_<key>_total
COUNTS = {
    "input_records": "Input records read (lines of text/JSONL files, rows of Parquet files).",
    "blank_records": "Input records that were empty or whitespace only.",
    "record_dead_letters": "Input records that could not be read as documents (dead letters).",
    "documents": "Documents (input records with text).",
    "sentences": "Sentences, written or dead-lettered.",
    "sentences_written": "Sentences written to the output.",
    "tokens_written": "Tokens written to the output.",
    "dead_letters": "Dead letters (record and sentence level).",
    "dead_letter_sentences": "Sentences dead-lettered (too long, no tokens, embedding failed, ...).",
}
# counts of a run with --dedupe or --reuse only
# (sentences_written = sentences_embedded + sentences_deduplicated + sentences_reused)
DEDUPE_COUNTS = {
    "sentences_embedded": "Sentences written with vectors the biLM computed for them.",
    "sentences_deduplicated": "Sentences written with the vectors of an equal sentence of the run (--dedupe).",
    "sentences_reused": "Sentences written with the stored vectors of an earlier output (--reuse).",
}
# counts of a run with --iceberg-mode upsert only (documents = unchanged + changed + added)
UPSERT_COUNTS = {
    "documents_unchanged": "Documents equal to the table's (same id and content hash): neither embedded nor written.",
    "documents_changed": "Documents whose content hash differs from the table's: embedded, their old rows removed.",
    "documents_added": "Documents new to the table: embedded and written.",
    "documents_removed": "Documents of the table no longer in the input, removed (--delete-missing).",
    "documents_kept": "Documents of the table no longer in the input, rows kept (no --delete-missing).",
}


def _escape(value: str) -> str:
    """A label value as the text format writes it; a name's bytes that are not UTF-8 (lone surrogates) as '?', so
    the file is always written (a failed run's exit status included)."""
    value = str(value).encode("utf-8", "replace").decode("utf-8")
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    return repr(float(v)) if math.isfinite(v) else ("+Inf" if v > 0 else "-Inf")


def render(families: list[tuple[str, str, str, list[tuple[dict, float]]]]) -> str:
    """Text of [(name, type, help, [(labels, value)])]: # HELP, # TYPE, then one line per sample."""
    lines = []
    for name, typ, help_text, samples in families:
        if not samples:
            continue
        lines.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        lines.append(f"# TYPE {name} {typ}")
        for labels, v in samples:
            lab = ",".join(f'{k}="{_escape(val)}"' for k, val in labels.items())
            lines.append(f"{name}{{{lab}}} {_value(v)}" if lab else f"{name} {_value(v)}")
    return "\n".join(lines) + "\n"


def metrics_families(manifest: dict, output: str, stage_seconds: dict[str, float] | None = None,
                     run_seconds: float | None = None, finished_at: float | None = None) -> list:
    """The metric families of a finished run: manifest counts (as counters), shards, resumed sentences, stage
    and run seconds, the finish time, and an info metric naming the run key and model."""
    out = {"output": redact(output)}
    counts = manifest.get("counts", {})
    run = manifest.get("run", {})
    fams = [(f"{PREFIX}{k}_total", "counter", h, [(out, int(counts.get(k, 0)))]) for k, h in COUNTS.items()]
    fams += [(f"{PREFIX}{k}_total", "counter", h, [(out, int(counts[k]))])
             for k, h in {**DEDUPE_COUNTS, **UPSERT_COUNTS}.items() if k in counts]
    fams.append((f"{PREFIX}sentences_reused_by_source_total", "counter",
                 "Sentences written with the stored vectors of each earlier output (--reuse).",
                 [({**out, "source": s}, int(n)) for s, n in counts.get("sentences_reused_by_source", {}).items()]))
    fams.append((f"{PREFIX}dead_letters_by_reason_total", "counter", "Dead letters by the kind of their reason.",
                 [({**out, "reason": r}, int(n)) for r, n in sorted(counts.get("dead_letters_by_reason", {}).items())]))
    fams.append((f"{PREFIX}resumed_sentences_total", "counter",
                 "Sentences committed by an interrupted run of the same command and skipped by this one.",
                 [(out, int(run.get("resumed_sentences", 0)))]))
    fams.append((f"{PREFIX}shards", "gauge", "Output shards (Parquet and/or HDF5 file sets).",
                 [(out, len(manifest.get("shards", [])))]))
    fams.append((f"{PREFIX}stage_seconds", "gauge",
                 "Wall seconds inside each stage, summed over worker processes (as report.html).",
                 [({**out, "stage": s}, float(v)) for s, v in (stage_seconds or {}).items()]))
    if run_seconds is not None:
        fams.append((f"{PREFIX}run_seconds", "gauge", "Wall seconds of the run until its finalize.",
                     [(out, float(run_seconds))]))
    if finished_at is not None:
        fams.append((f"{PREFIX}last_success_timestamp_seconds", "gauge",
                     "Unix time the output was finalized.", [(out, float(finished_at))]))
    model = manifest.get("model", {})
    fams.append((f"{PREFIX}run_info", "gauge", "The run key and model of the output (value 1).",
                 [({**out, "run_key": run.get("key", ""), "model": model.get("name", "")}, 1)]))
    return fams


def status_families(output: str, status: int, at: float) -> list:
    """Exit status and time of the command's end (pipeline.exits): what --metrics-file adds, alone on failure."""
    out = {"output": redact(output)}
    return [(f"{PREFIX}exit_status", "gauge", "Exit status of the last run (0 done; 75 retry later; "
             "docs/failure-behaviour.md#exit-statuses).", [(out, int(status))]),
            (f"{PREFIX}last_run_timestamp_seconds", "gauge", "Unix time the last run ended.", [(out, float(at))])]


def metrics_text(manifest: dict, output: str, stage_seconds: dict[str, float] | None = None,
                 run_seconds: float | None = None, finished_at: float | None = None) -> str:
    return render(metrics_families(manifest, output, stage_seconds, run_seconds, finished_at))
