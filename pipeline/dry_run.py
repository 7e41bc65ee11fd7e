"""`--dry-run` / `elmo-pipeline plan`: what a run of the same command would do, without touching --output.

estimate(): the run's plan (pipeline.plan.plan, without the object-store write probe), then
- inputs: every file matched, with its size;
- a sample (pipeline/sample.py): the lines starting in up to CHUNKS windows, about SAMPLE_BYTES in all, spread evenly over each
  sampled file (compressed and Parquet files: from their start), read by the run's readers under its bounds
  (--max-record-bytes; DECOMPRESSED_BYTES of a file at most), streamed, and tokenized with the run's own code;
  documents, sentences, tokens and dead letters scaled by stored bytes (Parquet: rows);
- time: the run's biLM (its threads, state and dtype) on length-sorted batches of sample sentences under
  --max-tokens-per-batch, its token cache warmed on them first and the first batch untimed; tokens/s of the
  rest. Tokenizing and encoding are timed on the same sample;
- output bytes: the sample's vectors encoded by the formats' own writers (formats/estimate.py), per token,
  times the tokens estimated; per layer and dtype from the widths;
- what --output holds now (already complete, a live run's lease, an interrupted finalize), read only, checked first:
  what the run would refuse there is refused with the run's status and message (output_state);
- --iceberg-mode upsert: the sample's documents compared with the table's state (read once at plan time,
  read only): documents unchanged, changed and added; sentences, tokens, output and time of the changed and
  added ones only, as the run embeds;
- how the work is split and spread: read elements (files and parts of files: pipeline/read_plan.py), files read
  whole because compressed, how documents reach the workers (work_split).
Nothing is created or written under --output (not even the folder or a lease).
"""
from __future__ import annotations

import math
import random
import time

from elmo_pipeline.pipeline.sample import SAMPLE_BYTES, sample_inputs

TIME_BATCHES = 6                # batches timed after the untimed first one, at most
TIME_SECONDS = 10.0             # ... or until this much time was spent embedding


def measure(pl, written: list, seed: int = 0) -> dict:
    """The run's biLM on batches of sample sentences: tokens/s, and the sample shard's bytes per token per format."""
    import numpy as np

    from elmo_pipeline.formats.estimate import sample_file_bytes
    from elmo_pipeline.model.batching import plan_batches
    from elmo_pipeline.transforms.embed import shared_model
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
    embedder = shared_model(pl.models, pl.spec).embedder
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
    """What --output holds now, as the run would find it, in the order it looks (output/lifecycle.py run): the
    finished run of this command, a live run's lease (dated as Lease.acquire dates it: output/lease.py
    check_free), then what prepare_output() meets under the lease (output/state.py survey): its refusals raised
    here as the run raises them (the same exit status and message: links, files in the way, a folder that holds
    no run, another command's run), an interrupted finalize. Reads only."""
    from elmo_pipeline.output.lease import LeaseHeld, check_free
    from elmo_pipeline.output.lifecycle import lease_url
    from elmo_pipeline.output.state import is_complete, survey
    o, so = pl.options, pl.storage_options
    if not o.overwrite and is_complete(o.output, pl.key, so):
        return "holds the finished run of this same command: `run` would exit 0 at once and change nothing"
    try:
        check_free(lease_url(o.output), o.lease_stale_seconds, so)
    except LeaseHeld as e:
        return f"has its lease held: {e}; `run` would exit 75 (retry later) now"
    found = survey(o.output, pl.key, pl.ingredients, o.overwrite, so, writes_state=pl.upsert is not None)
    if found.action == "complete":
        return "holds the finished run of this same command: `run` would exit 0 at once and change nothing"
    if found.action == "finalize" or (found.plan is not None and not found.finished):
        return "holds an interrupted finalize of this command: `run` would finish it"
    return "a run would start (or resume from shards this command committed there before)"


def estimate(argv: list[str], sample_bytes: int = SAMPLE_BYTES) -> dict:
    """The plan of `run ARGV` as numbers (see the module docstring)."""
    from elmo_pipeline.formats.estimate import layer_bytes
    from elmo_pipeline.pipeline.exits import after_plan
    from elmo_pipeline.pipeline.plan import pipeline_options, plan
    t_start = time.perf_counter()
    opts = pipeline_options(argv)
    pl = plan(opts, probe_output=False)
    state = output_state(pl)        # first: what the run would refuse, refused before the sample is read
    sizes = {url: int(size or 0) for url, (_, size, _) in zip(pl.files, pl.ingredients["inputs"])}  # plan() stat'ed them
    try:
        s = sample_inputs(pl, sizes, sample_bytes)
        written = s.pop("written")
        m = measure(pl, s.pop("timing"))
    except Exception as e:
        after_plan(e)
        raise
    est, spec = s["estimated"], pl.shard
    tokens = est["tokens_written"]
    h5_layers = 1 if spec.selection == "average" or list(spec.selection) == [spec.n_layers - 1] \
        else len(spec.selection)
    out_bytes = {f: round(b * tokens) for f, b in m["bytes_per_token"].items()}
    rate = m["tokens_per_s"]
    tok_rate = s["tokenized_tokens"] / s["tokenize_seconds"] if s["tokenize_seconds"] else 0.0
    enc_rate = m.get("sample_tokens", 0) / m["encode_seconds"] if m["encode_seconds"] else 0.0
    reuse, found = reused(pl, written, est) if pl.reuse else (None, frozenset())
    dedupe = deduplicated(pl.spec, written, est, reuse, found) if pl.dedupe else None
    upsert = upserted(pl, est, s.get("missing")) if pl.upsert else None
    embedded = tokens * (dedupe or reuse or {}).get("token_share", 1.0)     # dedupe's share leaves out the reused
    seconds = {"embed": embedded / rate if rate else None, "tokenize": tokens / tok_rate if tok_rate else None,
               "encode": tokens / enc_rate if enc_rate else None}
    return {
        "output": pl.options.output, "run_key": pl.key, "output_state": state,
        "inputs": [{"url": u, "bytes": sizes[u]} for u in pl.files], "input_bytes": sum(sizes.values()),
        "sample": {"bytes": s["sample_bytes"], "files": s["files_sampled"], **s["sampled"]},
        "estimated": est, "dedupe": dedupe, "reuse": reuse, **({"upsert": upsert} if upsert else {}),
        "formats": pl.formats, "dtype": pl.options.dtype, "layers": [c for c, _ in spec.columns],
        "output_bytes": out_bytes,
        "layer_bytes": layer_bytes(list(spec.columns) if "parquet" in spec.formats else [],
                                   h5_layers if "hdf5" in spec.formats else 0, spec.dim, tokens,
                                   list(spec.columns) if "arrow" in spec.formats else []),
        "shards_at_least": max(1, math.ceil(est["sentences_written"] / pl.options.shard_sentences),
                               math.ceil(tokens * spec.bytes_per_token / pl.options.shard_bytes)),
        "rate": {"tokens_per_s": rate, "timed_tokens": m["timed_tokens"], "timed_batches": m["timed_batches"],
                 "torch_threads": m.get("threads"), "tokenize_tokens_per_s": tok_rate, "encode_tokens_per_s": enc_rate},
        "seconds": seconds, "plan_seconds": time.perf_counter() - t_start, "work": work_split(pl, opts),
    }


def deduplicated(spec, written: list, est: dict, reused: dict | None = None, found: frozenset = frozenset()) -> dict:
    """--dedupe in the plan: the sample's written sentences of distinct sentence keys (spec: the run's ModelSpec),
    and the estimated sentences embedded and deduplicated at the sample's share; with --reuse (`reused`, and the
    keys its sources hold, `found`) what is reused is neither embedded nor deduplicated. A sample holds fewer of
    a corpus's repeats than the corpus: embedded is an upper bound, deduplicated a lower one."""
    prefix = spec.key_prefix
    keys = {spec.sentence_key(w[3], prefix): len(w[3]) for w in written}
    distinct = {k: n for k, n in keys.items() if k not in found}
    share = len(distinct) / len(written) if written else 1.0
    tokens = sum(len(w[3]) for w in written)
    embedded = round(est["sentences_written"] * share)
    return {"sampled_sentences": len(written), "sampled_distinct": len(keys), "sentences_embedded": embedded,
            "sentences_deduplicated": est["sentences_written"] - embedded - (reused or {}).get("sentences_reused", 0),
            "token_share": sum(distinct.values()) / tokens if tokens else 1.0}


def reused(pl, written: list, est: dict) -> tuple[dict, frozenset]:
    """--reuse in the plan: the sample's written sentences whose key the sources' key indexes hold (every key-index
    file read), the estimated sentences reused at the sample's share, and the share of tokens left to embed; and
    the keys found."""
    from elmo_pipeline.pipeline.reuse_sources import found_keys
    prefix = pl.spec.key_prefix
    keys = [(pl.spec.sentence_key(w[3], prefix), len(w[3])) for w in written]
    found = found_keys(pl.reuse, {k for k, _ in keys}, pl.storage_options)
    hit = [n for k, n in keys if k in found]
    tokens = sum(n for _, n in keys)
    return {"sources": [s.label for s in pl.reuse], "sampled_sentences": len(keys), "sampled_found": len(hit),
            "sentences_reused": round(est["sentences_written"] * len(hit) / len(keys)) if keys else 0,
            "token_share": 1 - sum(hit) / tokens if tokens else 1.0}, frozenset(k for k, _ in keys if k in found)


def upserted(pl, est: dict, missing: int | None) -> dict:
    """--iceberg-mode upsert in the plan: the table and the snapshot compared with, the estimated documents
    unchanged, changed and added (sample_inputs), and with --delete-missing the table's documents the input
    lacks: counted when the sample read every input document, else None (the run counts them)."""
    u = pl.upsert
    return {"table": u.target.table, "base_snapshot": u.base_snapshot, "table_documents": len(u.state),
            **{k: est[k] for k in ("documents_unchanged", "documents_changed", "documents_added")},
            "delete_missing": u.delete_missing, "documents_removed": missing if u.delete_missing else None}


def work_split(pl, opts) -> dict:
    """How the run splits and spreads its work: the read elements (pipeline.read_plan.describe), how documents
    reach the workers, and DaskRunner's partitions."""
    from elmo_pipeline.pipeline.read_plan import describe
    from elmo_pipeline.transforms.splits import Split
    splits = pl.splits or [Split(i) for i in range(len(pl.files))]
    from elmo_pipeline.fsio import redact
    work = describe(splits, [redact(f) for f in pl.files], pl.options.input_format, pl.split_bytes)
    work["spread"] = ("spread by the --id-field GroupByKey" if pl.unique_ids else
                      f"spread by a GroupByKey on a hash of their id into {pl.spread_buckets} buckets (the runner's "
                      "Reshuffle moves nothing)" if pl.spread_documents and pl.spread_buckets else
                      "spread by a Reshuffle" if pl.spread_documents else
                      "not spread (one local worker, or --state stateful)")
    partitions = opts.get_all_options().get("npartitions")
    if partitions:
        work["dask_partitions"] = partitions
    return work


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
    from elmo_pipeline.pipeline.streams import one_line    # names as written, one line each (no \n, no escapes)
    lines = [one_line(f"elmo-pipeline plan (--dry-run): nothing was written; --output {p['output']} "
                      f"{p['output_state']}"),
             f"run key {p['run_key']}",
             f"inputs: {len(p['inputs'])} file(s), {_size(p['input_bytes'])}"]
    lines += [one_line(f"  {i['url']}  {_size(i['bytes'])}") for i in p["inputs"][:20]]
    if len(p["inputs"]) > 20:
        lines.append(f"  ... and {len(p['inputs']) - 20} more")
    lines.append(f"sample: the lines starting in {_size(smp['bytes'])} of windows spread over {smp['files']} "
                 f"file(s): {smp['input_records']:,} records, {smp['documents']:,} documents, "
                 f"{smp['tokens_written']:,} tokens")
    lines.append(f"estimated (sample scaled by bytes): {e['input_records']:,} records, {e['documents']:,} documents, "
                 f"{e['sentences']:,} sentences, {e['tokens_written']:,} tokens written, "
                 f"{e['dead_letter_sentences'] + e['record_dead_letters']:,} dead letters")
    if p.get("dedupe"):
        d = p["dedupe"]
        lines.append(f"dedupe (one embedding per sentence key in the run): {d['sampled_distinct']:,} of the sample's "
                     f"{d['sampled_sentences']:,} sentences distinct: about {d['sentences_embedded']:,} sentences "
                     f"embedded, {d['sentences_deduplicated']:,} deduplicated (at least: a sample holds fewer "
                     "repeats than the corpus)")
    if p.get("reuse"):
        ru = p["reuse"]
        lines.append(f"reuse (vectors of {len(ru['sources'])} earlier output(s) by sentence key): "
                     f"{ru['sampled_found']:,} of the sample's {ru['sampled_sentences']:,} sentences found: about {ru['sentences_reused']:,} "
                     "sentences reused, not embedded")
    if p.get("upsert"):
        u = p["upsert"]
        gone = "" if not u["delete_missing"] else \
            f", {u['documents_removed']:,} of the table's removed (not in the input)" \
            if u["documents_removed"] is not None else \
            "; the table's documents not in the input (removed) are known at run time"
        lines.append(f"upsert into {u['table']} (snapshot {u['base_snapshot']}, {u['table_documents']:,} documents): "
                     f"about {u['documents_unchanged']:,} documents unchanged (not embedded), "
                     f"{u['documents_changed']:,} changed, {u['documents_added']:,} added{gone}; the sentences and "
                     "tokens above and the time below are those of the changed and added ones")
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
    w = p["work"]
    lines.append(f"work: {w['read_elements']:,} read element(s)" + (
        f", {w['files_split']} file(s) cut into parts of about {_size(w['split_bytes'])} (--split-bytes)"
        if w["files_split"] else ", one per file") + (
        f"; {w['dask_partitions']} Dask partition(s)" if "dask_partitions" in w else "")
        + f"; documents {w['spread']}")
    if w["read_whole_compressed"]:
        lines.append(one_line(f"  read whole (compressed, cannot be split): {len(w['read_whole_compressed'])} file(s), "
                              f"e.g. {w['read_whole_compressed'][0]}"))
    return "\n".join(lines)


def dry_run(argv: list[str]) -> str:
    return render(estimate(argv))
