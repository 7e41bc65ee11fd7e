"""`python -m pipeline.run`: corpus in, per-layer ELMo vectors out (Parquet + HDF5), on any Beam runner.

Graph (build()): ListFiles -> ReadFiles -> [SpreadDocuments] -> Tokenize -> [SkipCommitted] -> SortAndBatch
       -> Embed -> WriteShards -> Finalize (after all shards: move to final names, manifest.json, _SUCCESS);
       dead letters from Read/Tokenize/Embed -> WriteDeadLetters -> Finalize; record counts -> Finalize.
What varies with the options is settled once, before the graph, in plan().
The local default runner is FnApiRunner (never Prism, which Beam would try to download).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass

from pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam
from apache_beam.options.pipeline_options import (DirectOptions, PipelineOptions, S3Options,
                                                  SetupOptions, StandardOptions)

from formats import layout
from formats.hdf5 import hdf5_layout
from formats.parquet import layer_columns
from model.options import load_options
from pipeline.options import ElmoOptions, default_torch_threads
from pipeline.validate import check_model, check_numbers, check_output_writable, check_state
from storage import expand
from transforms import embed as E
from transforms.dofns import (DEAD, STATS, Embed, ReadFiles, SkipCommitted, SortAndBatch, SumCounts, Tokenize,
                              WriteDeadLetters, WriteShards)
from transforms.read import file_labels
from transforms.resume import OutputState, input_fingerprints, prepare_output, run_ingredients, run_key
from transforms.write import ShardSpec, complete_finalize, finalize

logger = logging.getLogger("elmo-pipeline.run")
LOCAL_RUNNERS = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")


def storage_options(opts: PipelineOptions) -> dict:
    """Storage options {protocol: {...}} from Beam's standard --s3_* flags (one config for both),
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


@dataclass
class Plan:
    """Everything the graph needs, settled once from the options (plan())."""
    o: ElmoOptions
    so: dict                       # storage options {protocol: {...}}
    files: list[str]               # expanded inputs
    labels: dict[str, str]         # file URL -> label used in document ids
    formats: list[str]
    spec: E.ModelSpec
    shard: ShardSpec               # formats, layout, layer selection and columns, dtype, row groups
    spread_documents: bool         # Reshuffle documents over workers (clusters; not one local worker)
    sort: bool                     # length-sort batches (not stateful: its batches are consecutive sentences)
    sentence_limit: int            # longer sentences are dead letters
    limit_flag: str                # the flag to name in their reason
    window: int                    # windowed sentences (0: none, stateful)
    progress: bool
    output: OutputState            # fresh / resume / finalize, the staging folder, committed shards
    manifest: dict                 # manifest.json as known before the run


def _num_local_workers(opts: PipelineOptions) -> int:
    d = opts.view_as(DirectOptions)
    return (d.direct_num_workers or 1) if d.direct_running_mode == "multi_processing" else 1


def plan(opts: PipelineOptions) -> Plan:
    """Check the options, the model and --output, and settle what the graph does. --output is touched last
    (prepare_output), after every check passed."""
    o = opts.view_as(ElmoOptions)
    if not o.input or not o.output:
        raise ValueError("--input and --output are required")
    check_numbers(o)
    formats = o.formats()
    so = storage_options(opts)
    files = expand(o.input, so)
    options_file, weight_file, vocab_file, model_name = resolve_model(o)
    bilm_opts = load_options(options_file)
    n_layers, dim = bilm_opts.n_layers + 1, bilm_opts.output_dim
    selection = E.parse_layers(o.layers, n_layers)
    columns = layer_columns(selection, dim, o.duplicate_layer0)
    local = (opts.view_as(StandardOptions).runner or "FnApiRunner") in LOCAL_RUNNERS
    workers = _num_local_workers(opts)
    o.batch_invariant = check_state(o.state, workers=workers, batch_invariant=o.batch_invariant)   # resolved
    stateful = o.state == "stateful"
    threads = o.torch_threads or (default_torch_threads(workers) if local else 0)
    spec = E.ModelSpec(options_file, weight_file, vocab_file, o.device, o.state, threads, o.compute_dtype,
                       o.batch_invariant)
    if local and o.device != "auto":   # fail fast on a missing GPU (without claiming one here)
        from model.device import resolve_device
        resolve_device(o.device)
    model = check_model(options_file, weight_file)       # a bad model fails here, not in every worker
    check_output_writable(o.output, so)          # last check: nothing was created before it
    identity = E.model_identity(spec)
    flags = {k: getattr(o, k) for k in o._visible_option_list()}
    ingredients = run_ingredients(flags, input_fingerprints(files, so), identity)
    key = run_key(ingredients)
    state = prepare_output(o.output, key, ingredients, o.overwrite, so, resumable=not stateful)
    if local and workers == 1:     # the worker runs in this process: it takes the model loaded above
        E.offer_model(options_file, weight_file, model)
    # stateful mode embeds sentences whole (windows are not consecutive sentences): longer than the window is dead
    limit, flag = o.max_sentence_tokens, "--max-sentence-tokens"
    if stateful and o.window_tokens < limit:
        limit, flag = o.window_tokens, "--window-tokens (--state stateful embeds sentences whole)"
    manifest = layout.manifest_header(
        {"name": model_name, **identity}, columns, hdf5_layout(selection, n_layers), flags, formats, files,
        {"key": key, "resumed_shards": len(state.records), "resumed_sentences": state.sentences})
    shard = ShardSpec(tuple(formats), o.parquet_layout, tuple(columns),
                      selection if selection == "average" else tuple(selection), o.duplicate_layer0, o.dtype,
                      o.row_group_bytes, n_layers, dim, o.vector_compression)
    return Plan(o, so, files, file_labels(files), formats, spec, shard,
                # a local runner materializes a Reshuffle in memory (peak RSS grew with the corpus:
                # benchmarks/pipeline_memory.py), so one local worker skips it; stateful keeps input order
                spread_documents=not stateful and not (local and workers == 1), sort=not stateful,
                sentence_limit=limit, limit_flag=flag, window=0 if stateful else o.window_tokens,
                progress=o.progress == "on" or (o.progress == "auto" and local and sys.stderr.isatty()),
                output=state, manifest=manifest)


def build(p: beam.Pipeline, pl: Plan) -> None:
    """The graph, top to bottom."""
    o, so, staging = pl.o, pl.so, pl.output.staging
    read = (p
            | "ListFiles" >> beam.Create(pl.files)
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadFiles" >> beam.ParDo(ReadFiles(o.input_format, pl.labels, o.text_field, o.id_field, so))
            .with_outputs(DEAD, STATS, main="docs"))
    docs = read.docs
    if pl.spread_documents:
        docs = docs | "SpreadDocuments" >> beam.Reshuffle()
    tok = docs | "Tokenize" >> beam.ParDo(Tokenize(o.tokenizer, pl.sentence_limit, pl.limit_flag)).with_outputs(DEAD, main="items")
    items = tok.items
    if pl.output.record_paths:   # resuming: drop the sentences an interrupted run of this command committed
        items = items | "SkipCommitted" >> beam.ParDo(SkipCommitted(pl.output.record_paths, so))
    emb = (items
           | "SortAndBatch" >> beam.ParDo(SortAndBatch(o.max_tokens_per_batch, o.sort_buffer, sort=pl.sort))
           | "Embed" >> beam.ParDo(Embed(pl.spec, pl.progress, window=pl.window, overlap=o.window_overlap,
                                         max_tokens=o.max_tokens_per_batch)).with_outputs(DEAD, main="batches"))
    shards = emb.batches | "WriteShards" >> beam.ParDo(WriteShards(staging, pl.shard, o.shard_sentences, so,
                                                                     o.shard_bytes))
    dead = ((read[DEAD], tok[DEAD], emb[DEAD])
            | "CollectDeadLetters" >> beam.Flatten()
            | "WriteDeadLetters" >> beam.ParDo(WriteDeadLetters(staging, so)))
    n_docs = docs | "CountDocuments" >> beam.combiners.Count.Globally()
    n_records = read[STATS] | "CountRecords" >> beam.CombineGlobally(SumCounts())
    manifest, output, resumed = pl.manifest, o.output, pl.output.shards

    def _finalize(_, shard_infos, dead_infos, documents, records):
        m = json.loads(json.dumps(manifest, default=str))
        m.setdefault("counts", {})["documents"] = documents
        m["counts"].update(layout.record_counts(records, dead_infos))
        yield finalize(output, staging, resumed + list(shard_infos), dead_infos, m, so)

    (p | "FinalizeTrigger" >> beam.Create([None])
       | "Finalize" >> beam.ParDo(_finalize, beam.pvalue.AsList(shards), beam.pvalue.AsList(dead),
                                  beam.pvalue.AsSingleton(n_docs), beam.pvalue.AsSingleton(n_records)))


def run(argv: list[str] | None = None, save_main_session: bool = False):
    """Plan, build and run the pipeline; waits for it and returns the PipelineResult.

    When --output only lacked the end of an interrupted Finalize of the same command (same run key,
    transforms/resume.py), that is completed and no pipeline runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--runner" or a.startswith("--runner=") for a in argv):
        argv.append("--runner=FnApiRunner")
    from pipeline.validate import check_flags
    check_flags(argv)          # unknown flags and bad values: one line, before anything runs
    opts = PipelineOptions(argv)
    opts.view_as(SetupOptions).save_main_session = save_main_session
    t0 = time.perf_counter()
    try:
        pl = plan(opts)
        if pl.output.action == "finalize":
            complete_finalize(pl.o.output, pl.output.staging, pl.so)
            result = FinalizeOnly()
        else:
            p = beam.Pipeline(options=opts)
            build(p, pl)
            result = p.run()
            result.wait_until_finish()
    finally:
        E.withdraw_models()
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
