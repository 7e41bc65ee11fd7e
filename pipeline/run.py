"""`python -m pipeline.run`: corpus in, per-layer ELMo vectors out (Parquet + HDF5), on any Beam runner.

run(): plan() settles what varies with the options (reading only); the run takes the output's lease
(fsio/lease.py); prepare_output() decides fresh / resume / finish a finalize; build() is the graph, which
only stages data under <out>/_staging/<run key>/:
    ListFiles -> ReadFiles -> [DropDuplicateIds | SpreadDocuments] -> Tokenize -> [SkipCommitted]
    -> SortAndBatch -> EmbedBatches -> WriteShards (shards + commit records); dead letters from every stage
    -> WriteDeadLetters; per-file record counts staged by ReadFiles.
Once the runner has finished, Finalize runs here, from what is staged (transforms/finalize.py).
The local default runner is FnApiRunner (never Prism, which Beam would try to download).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass

from pipeline.quiet import quiet_beam, quiet_failures

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam
from apache_beam.options.pipeline_options import (DirectOptions, PipelineOptions, S3Options,
                                                  SetupOptions, StandardOptions)

from formats import layout
from formats.hdf5 import hdf5_layout
from formats.iceberg import IcebergTarget
from formats.parquet import layer_columns, shard_schema
from model.options import load_options, sentences_independent
from pipeline.exits import after_plan
from pipeline.options import ElmoOptions, JobOptions, default_torch_threads
from pipeline.validate import (check_input_columns, check_inputs_outside_output, check_model, check_numbers,
                               check_output_writable, check_state)
from fsio import atomic_write, expand, redact, redact_logs, url_fs
from fsio.lease import Lease, RetryLater
from transforms import embed as E
from formats.layout import ShardInfo
from transforms import coders  # noqa: F401 - registers the element coders
from transforms.chain import Chain
from transforms.embed_step import EmbedBatches, SortAndBatch
from transforms.read_step import DropDuplicateIds, ReadFiles
from transforms.tokenize_step import Tokenize
from transforms.write_step import SkipCommitted, WriteShards
from transforms import progress as P
from transforms.finalize import Incomplete, complete_finalize, finalize, plan_from_staging
from transforms.ids import file_labels, public_url
from transforms.records import Document, Item
from transforms.resume import (OutputState, finalize_started, input_fingerprints, is_complete, prepare_output,
                               run_ingredients, run_key)
from transforms.write import ShardSpec

logger = logging.getLogger("elmo-pipeline.run")
BREAK_FUSION_ENV = "ELMO_PIPELINE_BREAK_FUSION"     # test hook: encode every element between stages
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
    """(options, weights, vocab, name) from --options-file/--weight-file or --model NAME (default: shipped;
    a published model is downloaded into the cache on first use and verified: model.pretrained)."""
    if o.options_file or o.weight_file:
        if not (o.options_file and o.weight_file) or o.model:
            raise ValueError("give --options-file and --weight-file together, or --model NAME, not both")
        return o.options_file, o.weight_file, o.vocab_file, "custom"
    from model.pretrained import DEFAULT_MODEL, model_files
    name = o.model or DEFAULT_MODEL
    options, weights, vocab = model_files(name, progress={"on": True, "off": False}.get(o.progress))
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
    unique_ids: bool               # group documents by --id-field value: duplicates become dead letters
    sort: bool                     # length-sort batches and lay them in lanes (model.options.sentences_independent)
    sentence_limit: int            # longer sentences are dead letters
    limit_flag: str                # the flag to name in their reason
    window: int                    # windowed sentences (0: none, stateful)
    progress: P.ProgressSpec | None    # the bar by input bytes (transforms/progress.py), or None: no bar
    break_fusion: bool             # a Reshuffle at every stage boundary (ELMO_PIPELINE_BREAK_FUSION=1, tests)
    key: str                       # the run key (transforms/resume.py)
    ingredients: dict              # what it hashes
    manifest: dict                 # manifest.json as known before the run
    tokenizer: str                 # --tokenizer resolved (raw -> the model's scheme: tokenization.resolve_tokenizer)
    tokenizer_processes: int       # child processes tokenizing for each worker (--tokenizer-process resolved)
    embed_threads: int = 1         # batches in the biLM at once per worker (--embed-threads resolved)
    iceberg: IcebergTarget | None = None    # --iceberg-table: where Finalize registers the Parquet shards
    schema: object = None          # the shards' Arrow schema (with --iceberg-table)
    registration: object = None    # what the registration did (formats.iceberg.Registration), once done

    def register(self, manifest: dict) -> None:
        """Finalize's hook (transforms/finalize.py): the finished output's shards into the Iceberg table."""
        self.registration = self.iceberg.register(self.o.output, manifest, self.schema, self.so)
        logger.info("%s", self.registration.describe())

    @property
    def registrar(self):
        return self.register if self.iceberg is not None else None


def _num_local_workers(opts: PipelineOptions) -> int:
    d = opts.view_as(DirectOptions)
    return (d.direct_num_workers or 1) if d.direct_running_mode == "multi_processing" else 1


def tokenizer_processes(flag: str, tokenizer: str, local: bool, runner: str, workers: int = 1) -> int:
    """--tokenizer-process resolved to a number of child processes per worker (0: tokenize inline): the
    cores each worker has, at most 2 and at least 1. auto: only where the tokenizer is costly (not
    whitespace), on local runners with a core beside the biLM. on: ValueError on DaskRunner, which drops the
    Items a child still owes at a bundle's end."""
    if flag == "on" and "DaskRunner" in runner:
        raise ValueError("--tokenizer-process on does not work with DaskRunner (it drops what a step emits "
                         "from finish_bundle: docs/runner-notes.md); use auto or off")
    cores = os.cpu_count() or 1
    if flag == "off" or flag == "auto" and not (local and tokenizer != "whitespace" and cores >= 2):
        return 0
    return max(1, min(2, cores // max(1, workers)))


def embed_threads(flag: int, torch_threads: int, local: bool, state: str, workers: int = 1,
                  tokenizer_children: int = 0) -> int:
    """--embed-threads resolved: the flag when given; auto (0): 2 on a local runner when each worker has a core
    beside its one torch thread that no tokenizer child takes (tokenizing inline) and the state lets batches
    run at once (not stateful), else 1. With tokenizer children on 2 cores, a second biLM thread only adds
    contention (benchmarks/README.md, host cost)."""
    if flag:
        return flag
    cores = os.cpu_count() or 1
    return 2 if (local and state != "stateful" and torch_threads == 1 and not tokenizer_children
                 and cores // max(1, workers) >= 2) else 1


def plan(opts: PipelineOptions, probe_output: bool = True) -> Plan:
    """Check the options, the model and --output, and settle what the graph does. Nothing is written under
    --output (on an object store, a probe object is written and removed: check_output_writable; not with
    probe_output=False, as for --dry-run, which checks only what it can read)."""
    o = opts.view_as(ElmoOptions)
    if not o.input or not o.output:
        raise ValueError("--input and --output are required")
    check_numbers(o)
    formats = o.formats()
    iceberg = IcebergTarget.from_flags(o.iceberg_table, o.iceberg_catalog, o.iceberg_warehouse, formats, o.dtype)
    so = storage_options(opts)
    files = expand(o.input, so)
    labels = file_labels(files, o.id_root, full=iceberg is not None and not o.id_field)
    check_input_columns(files, o.input_format, o.text_field, o.id_field, so)
    check_inputs_outside_output(files, o.output)
    options_file, weight_file, vocab_file, model_name = resolve_model(o)
    from model.pretrained import is_published, model_tokenization, model_urls
    from tokenization import resolve_tokenizer
    tokenization = model_tokenization(model_name)
    tokenizer = resolve_tokenizer(o.tokenizer, tokenization)
    local_options, local_weights, _ = E.fetch_model_files(options_file, weight_file, None, so)
    bilm_opts = load_options(local_options)
    n_layers, dim = bilm_opts.n_layers + 1, bilm_opts.output_dim
    selection = E.parse_layers(o.layers, n_layers)
    columns = layer_columns(selection, dim, o.duplicate_layer0)
    local = (opts.view_as(StandardOptions).runner or "FnApiRunner") in LOCAL_RUNNERS
    workers = _num_local_workers(opts)
    o.batch_invariant = check_state(o.state, workers=workers, batch_invariant=o.batch_invariant)   # resolved
    stateful = o.state == "stateful"
    threads = o.torch_threads or (default_torch_threads(workers) if local else 0)
    spec = E.ModelSpec(options_file, weight_file, vocab_file, o.device, o.state, threads, o.compute_dtype,
                       batch_invariant=o.batch_invariant, storage_options=so,
                       model_name=None if model_name == "custom" else model_name)
    if local and o.device != "auto":   # fail fast on a missing GPU (without claiming one here)
        from model.device import resolve_device
        resolve_device(o.device)
    model = check_model(local_options, local_weights)   # a bad model fails here, not in every worker
    if probe_output or "://" not in o.output or o.output.startswith("file://"):    # local: reads only
        check_output_writable(o.output, so)
    identity = E.model_identity(spec)
    spec = dataclasses.replace(spec, weights_sha256=identity["weights_sha256"])   # what workers elsewhere check
    flags = redact({k: getattr(o, k) for k in o._visible_option_list()})    # no secret in the manifest
    if o.id_root:
        flags["id_root"] = public_url(o.id_root)
    fingerprints = input_fingerprints(files, so)
    ingredients = run_ingredients(flags, redact(fingerprints), identity)   # as run.json records them
    if labels != file_labels(files):      # ids other than the default ones (--id-root itself is not in the key)
        ingredients["options"]["id_root"] = flags["id_root"] or "full paths (--iceberg-table)"
    key = run_key(ingredients)
    schema = shard_schema(o.parquet_layout, columns, o.dtype) if iceberg else None
    if iceberg:
        check_iceberg(iceberg, schema, o.output, key, o.overwrite, so)
    if local and workers == 1:     # the worker runs in this process: it takes the model loaded above
        E.offer_model(options_file, weight_file, model)
    # stateful mode embeds sentences whole (windows are not consecutive sentences): longer than the window is dead
    limit, flag = o.max_sentence_tokens, "--max-sentence-tokens"
    if stateful and o.window_tokens < limit:
        limit, flag = o.window_tokens, "--window-tokens (--state stateful embeds sentences whole)"
    model_entry = redact({"name": model_name, **identity, "tokenization": tokenization, "tokenizer": tokenizer,
                          **({"urls": model_urls(model_name)} if is_published(model_name) else {})})
    manifest = layout.manifest_header(
        model_entry, columns, hdf5_layout(selection, n_layers), flags, formats, redact(files), {"key": key})
    manifest["compute_support"] = compute_support_here(o.compute_dtype, o.device) if local else None
    shard = ShardSpec(tuple(formats), o.parquet_layout, tuple(columns),
                      selection if selection == "average" else tuple(selection), o.duplicate_layer0, o.dtype,
                      o.row_group_bytes, n_layers, dim, o.vector_compression)
    children = tokenizer_processes(o.tokenizer_process, tokenizer, local,
                                   opts.view_as(StandardOptions).runner or "FnApiRunner", workers)
    return Plan(o, so, files, labels, formats, spec, shard,
                # a local runner materializes a Reshuffle in memory (peak RSS grew with the corpus:
                # benchmarks/pipeline_memory.py), so one local worker skips it; stateful keeps input order
                spread_documents=not stateful and not (local and workers == 1),
                unique_ids=bool(o.id_field) and not stateful, sort=sentences_independent(o.state),
                sentence_limit=limit, limit_flag=flag, window=0 if stateful else o.window_tokens,
                progress=P.ProgressSpec(sum(f[1] or 0 for f in fingerprints), {f[0]: f[1] or 0 for f in fingerprints},
                                        workers) if o.progress == "on" or (o.progress == "auto" and local and
                                                                           sys.stderr.isatty()) else None,
                break_fusion=os.environ.get(BREAK_FUSION_ENV) == "1",
                key=key, ingredients=ingredients, manifest=manifest, tokenizer=tokenizer,
                tokenizer_processes=children,
                embed_threads=embed_threads(o.embed_threads or 0, threads, local, o.state, workers, children),
                iceberg=iceberg, schema=schema)


def compute_support_here(compute_dtype: str, device: str) -> dict:
    """The manifest's `compute_support`: how this machine (a local runner's workers run here) runs the biLM in
    the compute dtype on the device the workers pick (model.hardware.compute_support; no GPU is claimed)."""
    from model.device import resolve_device
    from model.hardware import compute_support
    return compute_support(compute_dtype, resolve_device(device))


def check_iceberg(iceberg: IcebergTarget, schema, output: str, key: str, overwrite: bool, so: dict) -> None:
    """Before a run with --iceberg-table: the catalog answers, an existing table takes this run's shards, and
    the table points at no files under --output that this run would replace (--overwrite, or an output that
    no longer holds the finished run registered from it): refused, since the table would then point at
    replaced files. Reads only."""
    held = iceberg.check(schema, output, so)
    if held and (overwrite or not finalize_started(output, key, so)):
        why = ("--overwrite would replace them" if overwrite else
               "it no longer holds the finished run of this command registered from it")
        raise ValueError(f"--iceberg-table {iceberg.table} already references Parquet files under {output} "
                         f"(snapshot {held[-1]}), and {why}: the table would point at replaced files. Write to a "
                         "new --output, or remove those files from the table first")


def build(p: beam.Pipeline, pl: Plan, state: OutputState) -> None:
    """The graph, top to bottom: one chain of single-output steps with typed elements, ending in one leaf.
    It only stages data under state.staging (dead letters and counts as side effects of the steps that
    find them); Finalize is run() after it. With pl.break_fusion every stage boundary is a Reshuffle, so
    every element is encoded and decoded with its coder (transforms/coders.py) on every runner."""
    o, so, staging = pl.o, pl.so, state.staging

    def stage(pcoll, label, *dofns, output_type):
        out = pcoll | label >> beam.ParDo(Chain(staging, so, *dofns)).with_output_types(output_type)
        return out | f"{label}Encoded" >> beam.Reshuffle() if pl.break_fusion else out

    files = p | "ListFiles" >> beam.Create(range(len(pl.files))) | "SpreadFiles" >> beam.Reshuffle()
    docs = stage(files, "ReadFiles", ReadFiles(o.input_format, pl.files, pl.labels, o.text_field, o.id_field, so,
                                               staging, pl.progress, o.max_record_bytes), output_type=Document)
    if pl.unique_ids:          # grouping by id also spreads the documents over workers
        keyed = docs | "KeyById" >> beam.Map(lambda d: (d.doc_id, d)).with_output_types(tuple[str, Document])
        docs = stage(keyed | "GroupById" >> beam.GroupByKey(), "DropDuplicateIds", DropDuplicateIds(pl.progress),
                     output_type=Document)
    elif pl.spread_documents and not pl.break_fusion:
        docs = docs | "SpreadDocuments" >> beam.Reshuffle()
    items = stage(docs, "Tokenize", Tokenize(pl.tokenizer, pl.sentence_limit, pl.limit_flag,
                                             processes=pl.tokenizer_processes, progress=pl.progress,
                                             max_document_tokens=o.max_document_tokens),
                  output_type=Item)
    if state.record_paths:   # resuming: drop the sentences an interrupted run of this command committed
        items = items | "SkipCommitted" >> beam.ParDo(
            SkipCommitted(state.record_paths, so, pl.progress)).with_output_types(Item)
    # batching, embedding and writing in one step: a bundle's last batches and shard never leave it. The count
    # (unused) gives the step a consumer across a stage boundary: FnApiRunner's multi-process mode notices a
    # dead worker on that data channel, and waits forever without one (docs/runner-notes.md)
    shards = items | "EmbedShards" >> beam.ParDo(Chain(
        staging, so,
        SortAndBatch(o.max_tokens_per_batch, o.sort_buffer, sort=pl.sort),
        EmbedBatches(pl.spec, pl.progress, window=pl.window, overlap=o.window_overlap,
                     max_tokens=o.max_tokens_per_batch, layers=pl.shard.layers_read, threads=pl.embed_threads),
        WriteShards(staging, pl.shard, o.shard_sentences, so, o.shard_bytes))).with_output_types(ShardInfo)
    _ = shards | "CountStagedShards" >> beam.combiners.Count.Globally()


MAX_ROUNDS = 3


def lease_url(output: str) -> str:
    return output.rstrip("/") + "/" + layout.LEASE


def pipeline_options(argv: list[str]) -> PipelineOptions:
    """The options of a command line, checked (unknown flags and bad values: ValueError, one line, before anything
    runs); the local default runner is FnApiRunner."""
    argv = list(argv)
    if not any(a == "--runner" or a.startswith("--runner=") for a in argv):
        argv.append("--runner=FnApiRunner")
    if any("DaskRunner" in a for a in argv):
        import apache_beam.runners.dask.dask_runner  # noqa: F401 - its options (--dask_client_address, ...)
    from pipeline.validate import check_flags
    check_flags(argv)
    return PipelineOptions(argv)


def run(argv: list[str] | None = None, save_main_session: bool = False):
    """Plan, take the output's lease, run the pipeline and finalize; returns the PipelineResult (or a
    NoPipeline when nothing had to run) with `manifest` and `elapsed_seconds`.

    A finished output of the same run key is left as it is ('already complete'); when --output only lacked
    the end of an interrupted Finalize of the same command, that is completed and no pipeline runs."""
    opts = pipeline_options(sys.argv[1:] if argv is None else argv)
    opts.view_as(SetupOptions).save_main_session = save_main_session
    t0 = time.perf_counter()
    try:
        pl = plan(opts)
        result = _run_planned(opts, pl)
    finally:
        E.withdraw_models()
        P.close()          # this process's bar (a local run's only worker runs here)
    result.elapsed_seconds = time.perf_counter() - t0
    result.iceberg = pl.registration
    return result


def _run_planned(opts: PipelineOptions, pl: Plan):
    """After plan(): 'already complete', or the run under the output's lease. A failure here is marked
    after_plan() (pipeline/exits.py: a ValueError now is no bad flag)."""
    try:
        if not pl.o.overwrite and is_complete(pl.o.output, pl.key, pl.so):
            result = AlreadyComplete(_manifest(pl))
            if pl.iceberg is not None:        # e.g. --iceberg-table newly given: registered now, once, under the
                with Lease(lease_url(pl.o.output), pl.o.lease_stale_seconds, pl.so):    # lease (no run replacing it)
                    if not is_complete(pl.o.output, pl.key, pl.so):
                        raise RetryLater(f"{pl.o.output} changed while this run waited for its lease; rerun")
                    pl.register(result.manifest)
        else:
            with Lease(lease_url(pl.o.output), pl.o.lease_stale_seconds, pl.so) as lease:
                result = _execute(opts, pl, lease)
    except Exception as e:
        after_plan(e)
        raise
    return result


def _manifest(pl: Plan) -> dict:
    fs, root = url_fs(pl.o.output, pl.so)
    return layout.read_manifest(fs, root) or {}


def _execute(opts: PipelineOptions, pl: Plan, lease: Lease):
    """Under the lease: prepare --output, run the graph (again, for what is missing, if a round left
    sentences unwritten), then finalize from what is staged."""
    first, started = None, time.time()
    for _ in range(MAX_ROUNDS):
        state = prepare_output(pl.o.output, pl.key, pl.ingredients, pl.o.overwrite, pl.so,
                               resumable=pl.o.state != "stateful")
        first = first or state
        if state.action == "complete":         # finished by another run meanwhile
            done = AlreadyComplete(_manifest(pl))
            if pl.iceberg is not None:
                pl.register(done.manifest)
            return done
        if state.action == "finalize":
            return FinalizeOnly(complete_finalize(pl.o.output, state.staging, pl.so, pl.registrar, lease.check_held))
        p = beam.Pipeline(options=opts)
        build(p, pl, state)
        result = p.run()
        try:
            result.wait_until_finish()
        finally:
            if getattr(result, "client", None) is not None:      # DaskRunner: its connection to the cluster
                result.client.close()
        if lease.lost.is_set():
            raise RetryLater(f"lost the lease on {pl.o.output} to another run while running; that run now "
                               "owns the output (this run's staged work is left for it)")
        try:
            staged = plan_from_staging(state.staging, pl.files, pl.so)
        except Incomplete as e:
            logger.warning("%s; another round embeds them", e)
            continue
        manifest = dict(pl.manifest, run={"key": pl.key, "resumed_shards": len(first.records),
                                          "resumed_sentences": first.sentences})
        result.manifest = finalize(pl.o.output, state.staging, staged, manifest, pl.so, pl.registrar,
                                   run_seconds=time.time() - started, fence=lease.check_held)
        result.resumed_tokens = sum(r["tokens"] for r in first.records)
        return result
    raise RetryLater(f"{pl.o.output}: sentences still missing after {MAX_ROUNDS} rounds; rerun the same command")


class NoPipeline:
    """run()'s result when no pipeline had to run."""
    state = "DONE"

    def __init__(self, manifest: dict | None):
        self.manifest = manifest or {}

    def wait_until_finish(self):
        return self.state

    def metrics(self):
        from apache_beam.runners.direct.direct_metrics import DirectMetrics
        return DirectMetrics()


class FinalizeOnly(NoPipeline):
    """Only an interrupted Finalize was left to do."""


class AlreadyComplete(NoPipeline):
    """--output already held the finished run of the same command: nothing was done."""


def counters(result) -> dict[str, int]:
    """Our Beam counters by name (committed values, or attempted where the runner has no committed); {} where
    the runner has no metrics (DaskRunner). Optional extras: the run's counts are in result.manifest."""
    try:
        found = result.metrics().query(beam.metrics.MetricsFilter().with_namespace("elmo"))["counters"]
    except NotImplementedError:
        return {}
    out = {}
    for c in found:
        v = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + (v or 0)
    return out


def summary(result, output: str) -> str:
    """The one-line summary printed at the end of a run: counts from the manifest (the data), batches and
    padding from the runner's metrics when it has them; the Iceberg snapshot with --iceberg-table."""
    registration = getattr(result, "iceberg", None)
    return _summary(result, output) + (f"; {registration.describe()}" if registration is not None else "")


def _summary(result, output: str) -> str:
    if isinstance(result, AlreadyComplete):
        return (f"elmo-pipeline: {output} is already complete (a finished run of this same command, run key "
                f"{result.manifest.get('run', {}).get('key')}): nothing to do")
    if isinstance(result, FinalizeOnly):
        return f"elmo-pipeline: finished the interrupted finalize of {output} (nothing else was left to do)"
    m = getattr(result, "manifest", {}) or {}
    n = m.get("counts", {})
    c = counters(result)
    secs = getattr(result, "elapsed_seconds", 0.0) or 0.0
    tokens = n.get("tokens_written", 0)
    embedded = tokens - getattr(result, "resumed_tokens", 0)
    slots = c.get("batch_token_slots", 0)
    batches = (f"{c.get('batches', 0)} batches (padding {1 - c.get('batch_tokens', 0) / slots:.1%}), "
               if slots else "")
    resumed = m.get("run", {}).get("resumed_sentences", 0)
    return (f"elmo-pipeline: {n.get('documents', 0)} documents, {n.get('sentences', 0)} sentences, "
            f"{tokens} tokens, {batches}{n.get('dead_letters', 0)} dead letters, {len(m.get('shards', []))} shards "
            f"in {secs:.1f} s ({embedded / secs if secs else 0:.0f} tokens/s) -> {output}"
            + (f" (resumed: {resumed} sentences already committed were skipped)" if resumed else ""))


def add_arguments(parser) -> None:
    """Our flags on an argparse parser (for `--help`; `run` itself is parsed by Beam)."""
    ElmoOptions._add_argparse_args(parser)


def job_flags(argv: list[str]):
    """--dry-run, --metrics-file, --verbose (pipeline.options.JobOptions) and --output, read leniently: they
    decide how a failure of the rest of the command line is reported."""
    import argparse

    class Lenient(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    parser = Lenient(add_help=False, allow_abbrev=False)
    JobOptions._add_argparse_args(parser)
    parser.add_argument("--output", default=None)
    try:
        return parser.parse_known_args(argv)[0]
    except ValueError:
        return argparse.Namespace(dry_run=False, metrics_file=None, verbose=False, output=None)


def write_metrics_file(path: str, output: str | None, status: int, manifest_metrics: str = "") -> None:
    """--metrics-file: the output's metrics.prom (when the run finished) and the exit status, written as the
    textfile collector needs it: beside `path` under a name it ignores (not *.prom), then renamed over it."""
    from formats.metrics import render, status_families
    fs, local = url_fs(path)
    atomic_write(fs, local, (manifest_metrics + render(status_families(output or "", status, time.time()))).encode())


def _output_metrics(output: str, so: dict | None = None) -> str:
    fs, root = url_fs(output, so)
    try:
        return fs.cat_file(root.rstrip("/") + "/" + layout.METRICS).decode("utf-8")
    except FileNotFoundError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """The command: one summary line and exit 0, or one line `error: ...` and the exit status of
    pipeline/exits.py (the traceback too with --verbose)."""
    from pipeline import exits
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    redact_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        import argparse
        parser = argparse.ArgumentParser(prog="python -m pipeline.run",
                                         description="ELMo vectors for a corpus with Apache Beam. "
                                         "Beam's standard options (--runner, --direct_num_workers, ...) also apply.")
        add_arguments(parser)
        parser.print_help()
        return exits.OK
    job = job_flags(argv)
    if not job.verbose:
        quiet_failures()
    try:
        if job.dry_run:
            from pipeline.dry_run import dry_run
            print(redact(dry_run(argv)))
            return exits.OK
        result = run(argv)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure ends in one line and a status
        failure = exits.classify(e)
        if job.verbose:
            import traceback
            print(redact("".join(traceback.format_exception(e))), end="", file=sys.stderr)
        print(failure.line(), file=sys.stderr)
        if job.metrics_file and not job.dry_run:
            _try_metrics_file(job.metrics_file, job.output, failure.status)
        return failure.status
    print(("\n" if sys.stderr.isatty() else "") + redact(summary(result, job.output)), file=sys.stderr)
    if job.metrics_file:
        _try_metrics_file(job.metrics_file, job.output, exits.OK,
                          lambda: _output_metrics(job.output, storage_options(PipelineOptions(argv))))
    return exits.OK


def _try_metrics_file(path: str, output: str | None, status: int, text=lambda: "") -> None:
    """--metrics-file with the exit status (and text(): the output's metrics, read back); a failure here is one
    warning line: the run's result and exit status stand, the collector file is an extra."""
    try:
        write_metrics_file(path, output, status, text())
    except Exception as e:  # noqa: BLE001
        print(redact(f"warning: --metrics-file {path}: {e}"), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
