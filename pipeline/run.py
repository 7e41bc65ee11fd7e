"""`python -m pipeline.run`: corpus in, per-layer ELMo vectors out (Parquet + HDF5), on any Beam runner.

Graph: ListFiles -> ReadFiles -> [Reshuffle] -> Tokenize -> [SkipCommitted, when resuming] -> SortAndBatch
       -> Embed -> WriteShards -> Finalize (after all shards: move to final names, manifest.json, _SUCCESS);
       dead letters from Read/Tokenize/Embed -> WriteDeadLetters -> Finalize; record counts -> Finalize.
The local default runner is FnApiRunner (never Prism, which Beam would try to download).
"""
from __future__ import annotations

import json
import logging
import sys
import time

from pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam
from apache_beam.options.pipeline_options import (DirectOptions, PipelineOptions, S3Options,
                                                  SetupOptions, StandardOptions)

from pipeline.options import ElmoOptions, default_torch_threads

logger = logging.getLogger("elmo-pipeline.run")
LOCAL_RUNNERS = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")


def storage_options(opts: PipelineOptions) -> dict:
    """fsspec storage options {protocol: {...}} from Beam's standard --s3_* flags (one config for both),
    plus botocore's retry policy from --s3-max-attempts."""
    s3 = opts.view_as(S3Options)
    so = {}
    if s3.s3_endpoint_url:
        so["endpoint_url"] = s3.s3_endpoint_url
    if s3.s3_access_key_id:
        so["key"], so["secret"] = s3.s3_access_key_id, s3.s3_secret_access_key
    if s3.s3_region_name:
        so["client_kwargs"] = {"region_name": s3.s3_region_name}
    attempts = opts.view_as(ElmoOptions).s3_max_attempts
    so["config_kwargs"] = {"retries": {"total_max_attempts": max(1, attempts), "mode": "standard"}}
    return {"s3": so}


def resolve_model(o: ElmoOptions) -> tuple[str, str, str | None, str]:
    """(options, weights, vocab, name) from --options-file/--weight-file or --model (default: shipped)."""
    if o.options_file or o.weight_file:
        if not (o.options_file and o.weight_file) or o.model:
            raise ValueError("give --options-file and --weight-file together, or --model NAME, not both")
        return o.options_file, o.weight_file, o.vocab_file, "custom"
    from model.pretrained import DEFAULT_MODEL, model_files
    name = o.model or DEFAULT_MODEL
    options, weights, vocab = model_files(name)
    return options, weights, o.vocab_file or vocab, name


def _num_local_workers(opts: PipelineOptions) -> int:
    d = opts.view_as(DirectOptions)
    return (d.direct_num_workers or 1) if d.direct_running_mode == "multi_processing" else 1


def build(p: beam.Pipeline, opts: PipelineOptions) -> dict | None:
    """Add the graph to `p`; returns the manifest skeleton (model identity, options).

    Returns None, adding nothing, when --output only lacked the end of an interrupted Finalize of the
    same command (same run key, transforms/resume.py), which is then completed here."""
    from model.options import load_options
    from transforms import embed as E
    from transforms.dofns import (DEAD, Embed, ReadFiles, SkipCommitted, SortAndBatch, Tokenize,
                                  WriteDeadLetters, WriteShards)
    from pipeline.validate import check_model, check_numbers, check_output_writable
    from transforms.dofns import STATS, SumCounts
    from transforms.read import expand_inputs, file_labels, record_counts
    from transforms.resume import input_fingerprints, prepare_output, run_ingredients, run_key
    from transforms.write import complete_finalize, finalize

    o = opts.view_as(ElmoOptions)
    if not o.input or not o.output:
        raise ValueError("--input and --output are required")
    check_numbers(o)
    formats = o.formats()
    so = storage_options(opts)
    files = expand_inputs(o.input, so)
    labels = file_labels(files)
    options_file, weight_file, vocab_file, model_name = resolve_model(o)
    bilm_opts = load_options(options_file)
    n_layers, dim = bilm_opts.n_layers + 1, bilm_opts.output_dim
    selection = E.parse_layers(o.layers, n_layers)
    columns = E.layer_columns(selection, dim, o.duplicate_layer0)
    runner = opts.view_as(StandardOptions).runner or "FnApiRunner"
    local = runner in LOCAL_RUNNERS
    workers = _num_local_workers(opts)
    if o.state == "stateful" and workers > 1:
        raise ValueError("--state stateful keeps input order in consecutive batches: run it with one worker")
    threads = o.torch_threads or (default_torch_threads(workers) if local else 0)
    spec = E.ModelSpec(options_file, weight_file, vocab_file, o.device, o.state, threads, o.compute_dtype)
    if local and o.device != "auto":   # fail fast on a missing GPU (without claiming one here)
        from model.embedder import resolve_device
        resolve_device(o.device)
    progress = o.progress == "on" or (o.progress == "auto" and local and sys.stderr.isatty())
    model = check_model(options_file, weight_file)       # a bad model fails here, not in every worker
    check_output_writable(o.output, so)          # last check: nothing was created before it
    identity = E.model_identity(spec)
    flags = {k: getattr(o, k) for k in o._visible_option_list()}
    ingredients = run_ingredients(flags, input_fingerprints(files, so), identity)
    key = run_key(ingredients)
    state = prepare_output(o.output, key, ingredients, o.overwrite, so, resumable=o.state != "stateful")
    if state.action == "finalize":
        complete_finalize(o.output, state.staging, so)
        return None
    staging, resumed = state.staging, state.shards
    if local and workers == 1:     # the worker runs in this process: it takes the model loaded above
        E.offer_model(options_file, weight_file, model)
    manifest = {
        "model": {"name": model_name, **identity},
        "layers": [c for c, _ in columns], "layer_dims": {c: d for c, d in columns},
        "hdf5_layout": E.hdf5_layout(selection, n_layers),
        "dtype": o.dtype, "compute_dtype": o.compute_dtype, "state": o.state, "tokenizer": o.tokenizer, "formats": formats,
        "parquet_layout": o.parquet_layout, "duplicate_layer0": o.duplicate_layer0,
        "inputs": files, "input_format": o.input_format,
        "options": flags,
        "run": {"key": key, "resumed_shards": len(resumed), "resumed_sentences": state.sentences},
    }

    names = p | "ListFiles" >> beam.Create(files)
    read = (names | "SpreadFiles" >> beam.Reshuffle()
            | "ReadFiles" >> beam.ParDo(ReadFiles(o.input_format, labels, o.text_field, o.id_field, so))
            .with_outputs(DEAD, STATS, main="docs"))
    docs = read.docs
    # Spreading documents over workers pays on a cluster; a local runner materializes a Reshuffle in
    # memory (peak RSS grew with the corpus: benchmarks/pipeline_memory.py), so one local worker skips it.
    if o.state != "stateful" and not (local and workers == 1):
        docs = docs | "SpreadDocuments" >> beam.Reshuffle()
    # stateful mode embeds sentences whole (windows are not consecutive sentences): longer than the window is dead
    limit, flag = o.max_sentence_tokens, "--max-sentence-tokens"
    if o.state == "stateful" and o.window_tokens < limit:
        limit, flag = o.window_tokens, "--window-tokens (--state stateful embeds sentences whole)"
    tok = docs | "Tokenize" >> beam.ParDo(Tokenize(o.tokenizer, limit, flag)).with_outputs(DEAD, main="items")
    items = tok.items
    if state.record_paths:   # resuming: drop the sentences an interrupted run of this command committed
        items = items | "SkipCommitted" >> beam.ParDo(SkipCommitted(state.record_paths, so))
    batches = items | "SortAndBatch" >> beam.ParDo(
        SortAndBatch(o.max_tokens_per_batch, o.sort_buffer, sort=o.state != "stateful"))
    emb = batches | "Embed" >> beam.ParDo(
        Embed(spec, selection, o.duplicate_layer0, o.dtype, formats, progress,
              window=0 if o.state == "stateful" else o.window_tokens, overlap=o.window_overlap,
              max_tokens=o.max_tokens_per_batch)).with_outputs(DEAD, main="rows")
    shards = emb.rows | "WriteShards" >> beam.ParDo(WriteShards(
        staging, formats, o.parquet_layout, columns, o.dtype, o.row_group_bytes, o.shard_sentences, so, o.shard_bytes))
    dead = ((read[DEAD], tok[DEAD], emb[DEAD]) | "CollectDeadLetters" >> beam.Flatten()
            | "WriteDeadLetters" >> beam.ParDo(WriteDeadLetters(staging, so)))
    n_docs = docs | "CountDocuments" >> beam.combiners.Count.Globally()
    n_records = read[STATS] | "CountRecords" >> beam.CombineGlobally(SumCounts())

    def _finalize(_, shard_infos, dead_infos, documents, records):
        m = json.loads(json.dumps(manifest, default=str))
        m.setdefault("counts", {})["documents"] = documents
        m["counts"].update(record_counts(records, dead_infos))
        yield finalize(o.output, staging, resumed + list(shard_infos), dead_infos, m, so)

    (p | "FinalizeTrigger" >> beam.Create([None])
       | "Finalize" >> beam.ParDo(_finalize, beam.pvalue.AsList(shards), beam.pvalue.AsList(dead),
                                  beam.pvalue.AsSingleton(n_docs), beam.pvalue.AsSingleton(n_records)))
    return manifest


def run(argv: list[str] | None = None, save_main_session: bool = False):
    """Build and run the pipeline; waits for it and returns the PipelineResult."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--runner" or a.startswith("--runner=") for a in argv):
        argv.append("--runner=FnApiRunner")
    from pipeline.validate import check_flags
    check_flags(argv)          # unknown flags and bad values: one line, before anything runs
    opts = PipelineOptions(argv)
    opts.view_as(SetupOptions).save_main_session = save_main_session
    t0 = time.perf_counter()
    p = beam.Pipeline(options=opts)
    try:
        if build(p, opts) is None:
            result = FinalizeOnly()
        else:
            result = p.run()
            result.wait_until_finish()
    finally:
        from transforms.embed import withdraw_models
        withdraw_models()
    result.elapsed_seconds = time.perf_counter() - t0
    return result


class FinalizeOnly:
    """run()'s result when only an interrupted Finalize was left to do (no pipeline ran)."""
    state = "DONE"

    def wait_until_finish(self):
        return self.state

    def metrics(self):
        from apache_beam.runners.direct.direct_metrics import DirectMetrics
        return DirectMetrics()


def counters(result) -> dict[str, int]:
    """Our Beam counters by name (committed values, or attempted where the runner has no committed)."""
    out = {}
    for c in result.metrics().query(beam.metrics.MetricsFilter().with_namespace("elmo"))["counters"]:
        v = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + (v or 0)
    return out


def summary(result, output: str) -> str:
    """The one-line summary printed at the end of a run."""
    if isinstance(result, FinalizeOnly):
        return f"elmo-pipeline: finished the interrupted finalize of {output} (nothing else was left to do)"
    c = counters(result)
    secs = getattr(result, "elapsed_seconds", 0.0) or 0.0
    slots = c.get("batch_token_slots", 0)
    pad = 1 - c.get("batch_tokens", 0) / slots if slots else 0.0
    return (f"elmo-pipeline: {c.get('documents', 0)} documents, {c.get('sentences', 0)} sentences, "
            f"{c.get('tokens', 0)} tokens, {c.get('batches', 0)} batches (padding {pad:.1%}), "
            f"{c.get('dead_letters', 0)} dead letters, {c.get('shards', 0)} shards in {secs:.1f} s "
            f"({c.get('tokens', 0) / secs if secs else 0:.0f} tokens/s) -> {output}"
            + (f" (resumed: {c['sentences_resumed']} sentences already committed were skipped)"
               if c.get("sentences_resumed") else ""))


def add_arguments(parser) -> None:
    """Our flags on an argparse parser (for `--help`; `run` itself is parsed by Beam)."""
    ElmoOptions._add_argparse_args(parser)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        import argparse
        parser = argparse.ArgumentParser(prog="python -m pipeline.run",
                                         description="ELMo vectors for a corpus with Apache Beam. "
                                         "Beam's standard options (--runner, --direct_num_workers, ...) also apply.")
        add_arguments(parser)
        parser.print_help()
        return 0
    try:
        result = run(argv)
    except (ValueError, OSError, RuntimeError) as e:   # OSError: files, permissions, object stores
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = PipelineOptions(argv).view_as(ElmoOptions).output
    print(("\n" if sys.stderr.isatty() else "") + summary(result, output), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
