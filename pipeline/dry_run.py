"""`--dry-run` / `elmo-pipeline plan`: what a run of the same command would do, without touching --output.

estimate(): the run's plan (pipeline.plan.plan, without the object-store write probe), then
- inputs: every file matched, with its size;
- a sample: the lines starting in up to CHUNKS windows, about SAMPLE_BYTES in all, spread evenly over each
  sampled file (compressed and Parquet files: from their start), read and tokenized with the run's own code;
  documents, sentences, tokens and dead letters scaled by stored bytes (Parquet: rows);
- time: the run's biLM (its threads, state and dtype) on length-sorted batches of sample sentences under
  --max-tokens-per-batch, its token cache warmed on them first and the first batch untimed; tokens/s of the
  rest. Tokenizing and encoding are timed on the same sample;
- output bytes: the sample's vectors encoded by the formats' own writers (formats/estimate.py), per token,
  times the tokens estimated; per layer and dtype from the widths;
- what --output holds now (already complete, a live run's lease), read only.
Nothing is created or written under --output (not even the folder or a lease).
"""
from __future__ import annotations

import io
import json
import math
import posixpath
import random
import time

SAMPLE_BYTES = 1 << 20          # stored bytes of the inputs read for the sample
CHUNKS = 32                     # slices per file, at most
MIN_CHUNK = 16 << 10            # bytes per slice, at least
MAX_SAMPLE_FILES = 64           # files sampled (evenly spaced by name) when there are more
TIME_BATCHES = 6                # batches timed after the untimed first one, at most
TIME_SECONDS = 10.0             # ... or until this much time was spent embedding
COMPRESSED = (".gz", ".bz2", ".zst", ".xz", ".lzma")


def _whole_lines(f, size: int, budget: int) -> tuple[list[bytes], int]:
    """(slices, bytes they stand for): the lines that start in each of up to CHUNKS windows spread evenly over a
    seekable file of `size` bytes, about `budget` bytes of windows in all. A line is taken whole when it starts
    in a window, so every line is as likely to be in the sample whatever its length (no bias to short lines)."""
    if size <= budget:
        return [f.read()], size
    n = max(1, min(CHUNKS, budget // MIN_CHUNK))
    width = budget // n
    out = []
    for j in range(n):
        start = j * size // n
        f.seek(max(0, start - 1))
        data = f.read(width + (1 if start else 0))
        if start > 0:                   # data[0] is the byte before the window: lines start after a newline
            cut = data.find(b"\n")
            data = data[cut + 1:] if cut >= 0 else b""
        while data and not data.endswith(b"\n"):      # the window's last line, to its end
            more = f.read(1 << 16)
            if not more:
                break
            cut = more.find(b"\n")
            data += more if cut < 0 else more[: cut + 1]
        if data:
            out.append(data)
    return out, n * width


def sample_file(url: str, size: int, budget: int, fmt: str, label: str, text_field: str, id_field: str | None,
                so: dict) -> tuple[list, float]:
    """(records, scale): records read from the file (Document, Blank, DeadLetter) and the factor from them to
    the whole file."""
    from elmo_pipeline.fsio import open_file
    from elmo_pipeline.transforms.lines import Meter
    from elmo_pipeline.transforms.read import line_records, read_documents
    if fmt != "parquet" and not url.endswith(COMPRESSED):
        with open_file(url, "rb", so) as f:
            slices, covered = _whole_lines(f, size, budget)
        records = [r for j, s in enumerate(slices)     # ids numbered in each slice: the slice in the label
                   for r in line_records(io.BytesIO(s), Meter(io.BytesIO(s)), fmt, f"{label}~{j}" if j else label,
                                          text_field, id_field)]
        return records, size / covered if covered else 0.0
    records, stored, done = [], 0, False
    for r in read_documents(url, fmt, label, text_field, id_field, so):
        nbytes = getattr(r, "nbytes", 0) or 0
        if nbytes and stored >= budget and fmt != "parquet":
            done = True
            break
        stored += nbytes
        records.append(r)
        if fmt == "parquet" and len(records) >= budget // 512:
            done = True
            break
    if not done:
        return records, 1.0
    if fmt == "parquet":
        import pyarrow.parquet as pq
        with open_file(url, "rb", so) as f:
            rows = pq.ParquetFile(f).metadata.num_rows
        return records, rows / len(records)
    return records, size / stored if stored else 0.0


def sample_inputs(pl, sizes: dict[str, int], budget: int = SAMPLE_BYTES) -> dict:
    """Counts of the sample, scaled to all inputs, and the sample's written sentences (tokens) for timing."""
    from elmo_pipeline.tokenization.process import tokenize_or_reason
    from elmo_pipeline.transforms.records import Blank, Document
    o = pl.options
    files = pl.files
    picked = files if len(files) <= MAX_SAMPLE_FILES else \
        [files[round(i * (len(files) - 1) / (MAX_SAMPLE_FILES - 1))] for i in range(MAX_SAMPLE_FILES)]
    picked_bytes = sum(sizes[f] for f in picked) or 1
    total_bytes = sum(sizes.values())
    keys = ("input_records", "blank_records", "record_dead_letters", "documents", "sentences",
            "sentences_written", "tokens_written", "dead_letter_sentences")
    est = dict.fromkeys(keys, 0.0)
    sampled = dict.fromkeys(keys, 0)
    written, tokenize_s, read_bytes = [], 0.0, 0
    for url in picked:
        share = max(MIN_CHUNK, int(budget * sizes[url] / picked_bytes))
        records, scale = sample_file(url, sizes[url], share, o.input_format, pl.labels[url], o.text_field,
                                     o.id_field, pl.storage_options)
        read_bytes += min(sizes[url], share)
        scale *= total_bytes / picked_bytes
        c = dict.fromkeys(keys, 0)
        for r in records:
            c["input_records"] += 1
            if isinstance(r, Blank):
                c["blank_records"] += 1
                continue
            if not isinstance(r, Document):
                c["record_dead_letters"] += 1
                continue
            c["documents"] += 1
            t0 = time.perf_counter()
            sentences = tokenize_or_reason(r.text, pl.tokenizer, r.split_sentences)
            tokenize_s += time.perf_counter() - t0
            if isinstance(sentences, str) or not sentences:
                c["sentences"] += 1
                c["dead_letter_sentences"] += 1
                continue
            for i, s in enumerate(sentences):
                c["sentences"] += 1
                if len(s.tokens) > pl.sentence_limit:
                    c["dead_letter_sentences"] += 1
                    continue
                c["sentences_written"] += 1
                c["tokens_written"] += len(s.tokens)
                written.append((f"{r.doc_id}#{i}", r.doc_id, i, list(s.tokens), list(s.offsets)))
        for k in keys:
            est[k] += c[k] * scale
            sampled[k] += c[k]
    return {"estimated": {k: round(v) for k, v in est.items()}, "sampled": sampled, "written": written,
            "tokenize_seconds": tokenize_s, "sample_bytes": read_bytes, "files_sampled": len(picked)}


def measure(pl, written: list, seed: int = 0) -> dict:
    """The run's biLM on batches of sample sentences: tokens/s, and the sample shard's bytes per token per format."""
    import numpy as np

    from elmo_pipeline.formats.estimate import sample_file_bytes
    from elmo_pipeline.model.batching import plan_batches
    from elmo_pipeline.transforms.embed import load_embedder
    o = pl.options
    limit = max(1, min(o.max_tokens_per_batch - 2, pl.window or o.max_tokens_per_batch))
    pool = [w for w in written if 0 < len(w[3]) <= limit]
    random.Random(seed).shuffle(pool)
    chosen, tokens = [], 0
    for w in pool:              # enough for the untimed batch and TIME_BATCHES more
        if tokens >= (TIME_BATCHES + 1) * o.max_tokens_per_batch:
            break
        chosen.append(w)
        tokens += len(w[3])
    if not chosen:
        return {"tokens_per_s": 0.0, "timed_tokens": 0, "timed_batches": 0, "bytes_per_token": {}, "encode_seconds": 0}
    embedder = load_embedder(pl.spec)
    batches = plan_batches([len(w[3]) for w in chosen], o.max_tokens_per_batch, sort=pl.sort, lanes=pl.sort)
    for b in batches:     # the token cache warmed on these sentences, as a run's is by the corpus's frequent words
        embedder.prepare_packed([chosen[i][3] for i in b])
    layers = pl.shard.layers_read
    outs, timed_tokens, timed_s, timed_batches, order = [], 0, 0.0, 0, []
    for n, b in enumerate(batches):
        t0 = time.perf_counter()
        vectors, offsets = embedder.embed_packed([chosen[i][3] for i in b], layers)
        dt = time.perf_counter() - t0
        outs.append((vectors, offsets))
        order += b
        if n > 0 or len(batches) == 1:
            timed_tokens += int(offsets[-1])
            timed_s += dt
            timed_batches += 1
        if n >= TIME_BATCHES or (n > 0 and timed_s >= TIME_SECONDS):
            break
    vectors = np.concatenate([v for v, _ in outs], axis=1)
    packed = np.concatenate([[0]] + [off[1:] + base for (_, off), base in
                                     zip(outs, np.cumsum([0] + [int(off[-1]) for _, off in outs[:-1]]))])
    ws = [chosen[i] for i in order]
    spec = pl.shard
    t0 = time.perf_counter()
    sizes = sample_file_bytes(spec, [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws], [w[3] for w in ws],
                              [w[4] for w in ws], vectors, packed, layers)
    encode_s = time.perf_counter() - t0
    n_tok = int(packed[-1])
    return {"tokens_per_s": timed_tokens / timed_s if timed_s else 0.0, "timed_tokens": timed_tokens,
            "timed_batches": timed_batches, "threads": _threads(), "sample_tokens": n_tok,
            "bytes_per_token": {f: b / n_tok for f, b in sizes.items()}, "encode_seconds": encode_s}


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def output_state(pl) -> str:
    """What --output holds now, as the run would find it (read only)."""
    from elmo_pipeline.output.names import LEASE
    from elmo_pipeline.fsio import url_fs
    from elmo_pipeline.fsio.lease import describe, is_stale
    from elmo_pipeline.output.state import finalize_started, is_complete
    o, so = pl.options, pl.storage_options
    if not o.overwrite and is_complete(o.output, pl.key, so):
        return "holds the finished run of this same command: `run` would exit 0 at once and change nothing"
    fs, root = url_fs(o.output, so)
    try:
        holder = json.loads(fs.cat_file(posixpath.join(root, LEASE)))
    except (FileNotFoundError, ValueError):
        holder = None
    if holder and not is_stale(holder, o.lease_stale_seconds):
        return f"is held by a live run ({describe(holder)}): `run` would exit 75 (retry later) now"
    if finalize_started(o.output, pl.key, so):
        return "holds an interrupted finalize of this command: `run` would finish it"
    return "a run would start (or resume from shards this command committed there before)"


def estimate(argv: list[str], sample_bytes: int = SAMPLE_BYTES) -> dict:
    """The plan of `run ARGV` as numbers (see the module docstring)."""
    from elmo_pipeline.formats.estimate import layer_bytes
    from elmo_pipeline.pipeline.exits import after_plan
    from elmo_pipeline.pipeline.plan import pipeline_options, plan
    from elmo_pipeline.transforms.embed import withdraw_models
    t_start = time.perf_counter()
    opts = pipeline_options(argv)
    try:
        pl = plan(opts, probe_output=False)
        sizes = {url: int(size or 0) for url, (_, size, _) in zip(pl.files, pl.ingredients["inputs"])}  # plan() stat'ed them
        try:
            s = sample_inputs(pl, sizes, sample_bytes)
            m = measure(pl, s.pop("written"))
        except Exception as e:
            after_plan(e)
            raise
    finally:
        withdraw_models()
    est, spec = s["estimated"], pl.shard
    tokens = est["tokens_written"]
    h5_layers = 1 if spec.selection == "average" or list(spec.selection) == [spec.n_layers - 1] \
        else len(spec.selection)
    out_bytes = {f: round(b * tokens) for f, b in m["bytes_per_token"].items()}
    rate = m["tokens_per_s"]
    tok_rate = s["sampled"]["tokens_written"] / s["tokenize_seconds"] if s["tokenize_seconds"] else 0.0
    enc_rate = m.get("sample_tokens", 0) / m["encode_seconds"] if m["encode_seconds"] else 0.0
    seconds = {"embed": tokens / rate if rate else None, "tokenize": tokens / tok_rate if tok_rate else None,
               "encode": tokens / enc_rate if enc_rate else None}
    return {
        "output": pl.options.output, "run_key": pl.key, "output_state": output_state(pl),
        "inputs": [{"url": u, "bytes": sizes[u]} for u in pl.files], "input_bytes": sum(sizes.values()),
        "sample": {"bytes": s["sample_bytes"], "files": s["files_sampled"], **s["sampled"]},
        "estimated": est,
        "formats": pl.formats, "dtype": pl.options.dtype, "layers": [c for c, _ in spec.columns],
        "output_bytes": out_bytes,
        "layer_bytes": layer_bytes(list(spec.columns) if "parquet" in spec.formats else [],
                                   h5_layers if "hdf5" in spec.formats else 0, spec.dim, tokens),
        "shards_at_least": max(1, math.ceil(est["sentences_written"] / pl.options.shard_sentences),
                               math.ceil(tokens * spec.bytes_per_token / pl.options.shard_bytes)),
        "rate": {"tokens_per_s": rate, "timed_tokens": m["timed_tokens"], "timed_batches": m["timed_batches"],
                 "torch_threads": m.get("threads"), "tokenize_tokens_per_s": tok_rate, "encode_tokens_per_s": enc_rate},
        "seconds": seconds, "plan_seconds": time.perf_counter() - t_start,
    }


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return ""


def _dur(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:,.0f} s" if s < 120 else f"{s / 60:,.1f} min" if s < 7200 else f"{s / 3600:,.1f} h"


def render(p: dict) -> str:
    """The plan as text, one fact a line."""
    e, r, sec, smp = p["estimated"], p["rate"], p["seconds"], p["sample"]
    lines = [f"elmo-pipeline plan (--dry-run): nothing was written; --output {p['output']} {p['output_state']}",
             f"run key {p['run_key']}",
             f"inputs: {len(p['inputs'])} file(s), {_size(p['input_bytes'])}"]
    lines += [f"  {i['url']}  {_size(i['bytes'])}" for i in p["inputs"][:20]]
    if len(p["inputs"]) > 20:
        lines.append(f"  ... and {len(p['inputs']) - 20} more")
    lines.append(f"sample: the lines starting in {_size(smp['bytes'])} of windows spread over {smp['files']} "
                 f"file(s): {smp['input_records']:,} records, {smp['documents']:,} documents, "
                 f"{smp['tokens_written']:,} tokens")
    lines.append(f"estimated (sample scaled by bytes): {e['input_records']:,} records, {e['documents']:,} documents, "
                 f"{e['sentences']:,} sentences, {e['tokens_written']:,} tokens written, "
                 f"{e['dead_letter_sentences'] + e['record_dead_letters']:,} dead letters")
    lines.append(f"output ({', '.join(p['formats'])}; --dtype {p['dtype']}; layers {', '.join(p['layers'])}): "
                 + ", ".join(f"{f} {_size(b)}" for f, b in p["output_bytes"].items())
                 + f"; at least {p['shards_at_least']} shard(s)")
    lines.append("  vectors per layer (float32 / float16):")
    for row in p["layer_bytes"]:
        lines.append(f"    {row['format']:8} {row['layer']:10} {row['dim']:>5} wide: {_size(row['float32']):>10} / "
                     f"{_size(row['float16']):>10}")
    lines.append(f"time at this machine's measured rate: biLM {_dur(sec['embed'])} ({r['tokens_per_s']:,.0f} tokens/s: "
                 f"{r['timed_tokens']:,} sample tokens in {r['timed_batches']} batch(es) of --max-tokens-per-batch, "
                 f"token cache warm, after an untimed first one, {r['torch_threads']} torch thread(s)); tokenizing {_dur(sec['tokenize'])}, "
                 f"encoding {_dur(sec['encode'])} (one thread each; a run overlaps part of them with the biLM)")
    return "\n".join(lines)


def dry_run(argv: list[str]) -> str:
    return render(estimate(argv))
