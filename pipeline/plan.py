"""What a run of `python -m elmo_pipeline.pipeline.run` does, settled from its options before anything runs: plan() checks the
options, the model (model/resolve.py) and --output, and returns a Plan, which the graph (pipeline/graph.py), the
run under the output's lease (pipeline/execute.py) and --dry-run (pipeline/dry_run.py) take. Reads only.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, S3Options, StandardOptions
from apache_beam.utils import shared

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.hdf5 import hdf5_layout
from elmo_pipeline.formats.iceberg import IcebergTarget, check_overwrite, output_url
from elmo_pipeline.formats.iceberg.upsert import Upsert, settings_salt
from elmo_pipeline.formats.parquet import layer_columns, shard_schema
from elmo_pipeline.fsio import expand, redact, url_fs
from elmo_pipeline.model.options import load_options, sentences_independent
from elmo_pipeline.model.resolve import resolve_model
from elmo_pipeline.pipeline.options import ElmoOptions, default_torch_threads
from elmo_pipeline.pipeline.validate import (check_dedupe, check_input_columns, check_model, inputs_outside_output, own_files,
                               check_numbers, check_output_writable, check_reuse, check_state)
from elmo_pipeline.model.resolve import ModelSpec
from elmo_pipeline.transforms.embed import parse_layers
from elmo_pipeline.transforms.embed_step import shared_model
from elmo_pipeline.transforms.progress import ProgressSpec
from elmo_pipeline.transforms.reuse import ReuseSource, open_source, table_sources
from elmo_pipeline.transforms.splits import Split, plan_splits, split_size
from elmo_pipeline.transforms.ids import file_labels, public_url
from elmo_pipeline.output.state import finalize_started, input_fingerprints, run_ingredients, run_key
from elmo_pipeline.output import manifest as manifests
from elmo_pipeline.output.lifecycle import Job
from elmo_pipeline.output.register import register
from elmo_pipeline.output.staging import ShardSpec

logger = logging.getLogger("elmo-pipeline.run")
LOCAL_RUNNERS = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")
IDENTITY_RESHUFFLE = ("DaskRunner",)    # runners whose Reshuffle moves nothing (apache_beam/runners/dask/overrides.py)
MAX_PARTITIONS = 1024       # DaskRunner partitions chosen from the corpus: one per read element, at most this many
BUCKET_BYTES = 16 << 20     # documents spread by key: at least 4 buckets per partition, and this many bytes of input
                            # per bucket at most on average (a group is held in memory)


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


@dataclass
class Plan:
    """Everything the graph needs, settled once from the options (plan())."""
    options: ElmoOptions
    storage_options: dict          # {protocol: {...}}
    files: list[str]               # expanded inputs
    labels: dict[str, str]         # file URL -> label used in document ids
    formats: list[str]
    spec: ModelSpec                # the model and what changes its vectors (model/resolve.py), pinned
    shard: ShardSpec               # formats, layout, layer selection and columns, dtype, row groups
    spread_documents: bool         # Reshuffle documents over workers (clusters; not one local worker)
    unique_ids: bool               # group documents by --id-field value: duplicates become dead letters
    sort: bool                     # length-sort batches and lay them in lanes (model.options.sentences_independent)
    sentence_limit: int            # longer sentences are dead letters
    limit_flag: str                # the flag to name in their reason
    window: int                    # windowed sentences (0: none, stateful)
    progress: ProgressSpec | None  # the bar by input bytes (transforms/progress.py), or None: no bar
    key: str                       # the run key (output/state.py)
    ingredients: dict              # what it hashes
    manifest: dict                 # manifest.json as known before the run
    tokenizer: str                 # --tokenizer resolved (raw -> the model's scheme: tokenization.resolve_tokenizer)
    tokenizer_processes: int       # child processes tokenizing for each worker (--tokenizer-process resolved)
    embed_threads: int = 1         # batches in the biLM at once per worker (--embed-threads resolved)
    break_fusion: bool = False     # a Reshuffle at every stage boundary: every element encoded (tests set it)
    dedupe: bool = False           # one embedding per sentence key (--dedupe resolved: transforms/dedupe.py)
    iceberg: IcebergTarget | None = None    # --iceberg-table: where Finalize registers the Parquet shards
    upsert: Upsert | None = None   # --iceberg-mode upsert: the table's state compared with, and the commit
    schema: object = None          # the shards' Arrow schema (with --iceberg-table)
    registration: object = None    # what the registration did (formats.iceberg.Registration), once done
    models: shared.Shared = field(default_factory=shared.Shared)   # the workers' model handle
    loaded: object = None          # the launcher's hold on it (transforms.embed_step.shared_model), local runs
    splits: list[Split] = field(default_factory=list)   # the read elements (transforms/splits.py); [] one per file
    split_bytes: int = 0           # --split-bytes resolved (0: whole files)
    fingerprints: dict = field(default_factory=dict)    # file URL -> [size, version] when planned: each read checks it
    spread_buckets: int = 0        # > 0: documents spread by a GroupByKey on a hash of their id into this many
                                   # buckets (runners whose Reshuffle moves nothing), else by a Reshuffle
    reuse: list[ReuseSource] = field(default_factory=list)   # --reuse sources, checked (transforms/reuse.py)

    def register(self, manifest: dict, fence: Callable[[], None] | None = None) -> None:
        """Finalize's hook (output/register.py): the finished output's shards into the Iceberg table, fenced by
        `fence` (the run's lease)."""
        self.registration = register(self.options.output, manifest, self.upsert if self.upsert is not None
                                     else self.iceberg, self.schema, self.storage_options, fence)

    @property
    def registrar(self):
        return self.register if self.iceberg is not None else None

    def job(self) -> Job:
        """What the output's life needs of this plan (output/lifecycle.py)."""
        o = self.options
        return Job(o.output, self.key, self.ingredients, self.manifest, self.files, self.storage_options,
                   overwrite=o.overwrite, resumable=o.state != "stateful", lease_stale_seconds=o.lease_stale_seconds,
                   register=self.registrar, upsert=self.upsert)


def spread_by_key(runner: str) -> bool:
    """Whether documents must be spread by a keyed GroupByKey: the runner's Reshuffle moves nothing."""
    return any(r in runner for r in IDENTITY_RESHUFFLE)


def dask_partitions(opts: PipelineOptions, elements: int) -> int:
    """DaskRunner's partitions of the read elements (the parallelism of every step, Dask running a partition as
    one task): --dask_npartitions when given, else one per read element up to MAX_PARTITIONS, set in `opts` for
    the runner (Beam's own default puts up to 128 elements in one partition: one worker)."""
    from apache_beam.runners.dask.dask_runner import DaskOptions
    d = opts.view_as(DaskOptions)
    if not d.npartitions and not d.partition_size:
        d.npartitions = max(1, min(MAX_PARTITIONS, elements))
    return d.npartitions or max(1, -(-elements // d.partition_size))


def local_workers(opts: PipelineOptions) -> int:
    """The worker processes of a local run: --direct_num_workers in multi_processing mode, else 1."""
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
    check_upsert(o, iceberg)
    if iceberg is not None and any(c in o.output.split("://", 1)[-1] for c in "#?"):
        raise ValueError(f"--iceberg-table: --output {redact(o.output)} holds '#' or '?', which a table's file URLs "
                         "cannot carry (read as a fragment or a query); write to a folder named without them")
    so = storage_options(opts)
    files = inputs_outside_output(expand(o.input, so), o.input, o.output, lambda: own_files(o.output, so))
    labels = file_labels(files, o.id_root, full=iceberg is not None and not o.id_field)
    check_input_columns(files, o.input_format, o.text_field, o.id_field, so)
    resolved = resolve_model(o.model, o.options_file, o.weight_file, o.vocab_file, so,
                             progress={"on": True, "off": False}.get(o.progress))
    from elmo_pipeline.model.pretrained import is_published, model_urls
    from elmo_pipeline.tokenization import resolve_tokenizer
    model_name, tokenization = resolved.name, resolved.tokenization
    tokenizer = resolve_tokenizer(o.tokenizer, tokenization)
    local_options, local_weights, _ = resolved.local_files()
    bilm_opts = load_options(local_options)
    n_layers, dim = bilm_opts.n_layers + 1, bilm_opts.output_dim
    selection = parse_layers(o.layers, n_layers)
    columns = layer_columns(selection, dim, o.duplicate_layer0)
    local = (opts.view_as(StandardOptions).runner or "FnApiRunner") in LOCAL_RUNNERS
    workers = local_workers(opts)
    o.batch_invariant = check_state(o.state, workers=workers, batch_invariant=o.batch_invariant)   # resolved
    stateful = o.state == "stateful"
    dedupe = check_dedupe(o.dedupe, o.state, o.batch_invariant)
    check_reuse(o.reuse, o.state, o.output, o.reuse_table)
    threads = o.torch_threads or (default_torch_threads(workers) if local else 0)
    from elmo_pipeline.model.windows import effective_overlap, effective_window
    from elmo_pipeline.tokenization import tokenizer_version
    spec = dataclasses.replace(
        resolved, device=o.device, state=o.state, torch_threads=threads, compute_dtype=o.compute_dtype,
        batch_invariant=o.batch_invariant, dtype=o.dtype, duplicate_layer0=o.duplicate_layer0,
        layers=selection if selection == "average" else ",".join(map(str, selection)),
        window=0 if stateful or not o.window_tokens else effective_window(o.window_tokens, o.max_tokens_per_batch),
        overlap=0 if stateful or not o.window_tokens else effective_overlap(o.window_tokens, o.window_overlap,
                                                                               o.max_tokens_per_batch),
        tokenizer=tokenizer, tokenizer_version=tokenizer_version(tokenizer))
    from elmo_pipeline.model.device import check_batch_invariant, resolve_device
    if local and o.device != "auto":   # fail fast on a missing GPU (without claiming one here)
        resolve_device(o.device)
    if o.batch_invariant and (local or o.device != "auto"):   # remote 'auto': each worker's embedder checks
        check_batch_invariant(o.device)
    model = check_model(local_options, local_weights)   # a bad model fails here, not in every worker
    if probe_output or "://" not in o.output or o.output.startswith("file://"):    # local: reads only
        check_output_writable(o.output, so)
    if o.overwrite:          # an output registered in a table this command does not name: refused
        check_overwrite(o.output, layout.read_manifest(*url_fs(o.output, so)), iceberg)
    spec = spec.pinned()        # what workers elsewhere check, and what the key prefix hashes
    reuse = [open_source(s, spec.key_prefix, columns, o.dtype, so) for s in o.reuse or ()]
    if o.reuse_table:        # the outputs registered in the table: sources too, unless foreign (logged)
        reuse += table_sources(iceberg.table, iceberg.registered_outputs(so), spec.key_prefix, columns, o.dtype,
                               [output_url(u) for u in [o.output, *(o.reuse or ())]], so)
    identity = {**spec.identity(), "batch_invariant": o.batch_invariant}
    flags = redact({k: getattr(o, k) for k in o._visible_option_list()})    # no secret in the manifest
    if o.id_root:
        flags["id_root"] = public_url(o.id_root)
    fingerprints = input_fingerprints(files, so)
    ingredients = run_ingredients(flags, redact(fingerprints), identity)   # as run.json records them
    if labels != file_labels(files):      # ids other than the default ones (--id-root itself is not in the key)
        ingredients["options"]["id_root"] = flags["id_root"] or "full paths (--iceberg-table)"
    if o.iceberg_mode == "upsert":        # only the changed documents are written: another output
        ingredients["options"].update(iceberg_mode=o.iceberg_mode, delete_missing=o.delete_missing)
    key = run_key(ingredients)
    # a local runner materializes a Reshuffle in memory (peak RSS grew with the corpus:
    # benchmarks/pipeline_memory.py), so one local worker skips it; stateful keeps input order
    spread = not stateful and not (local and workers == 1)
    if stateful and o.split_bytes > 0:
        raise ValueError("--split-bytes needs --state stateless or warm (stateful reads each file in order)")
    sizes = {f[0]: f[1] or 0 for f in fingerprints}       # auto: files are cut only where the work is spread
    split = split_size(o.split_bytes, sum(sizes.values())) if o.split_bytes > 0 or spread else 0
    splits = plan_splits(files, sizes, o.input_format, split, so)
    runner = opts.view_as(StandardOptions).runner or "FnApiRunner"
    buckets = 0
    if spread_by_key(runner):
        partitions = dask_partitions(opts, len(splits)) if "DaskRunner" in runner else len(splits)
        buckets = max(4 * partitions, sum(sizes.values()) // BUCKET_BYTES)
    schema = shard_schema(o.parquet_layout, columns, o.dtype) if iceberg else None
    if iceberg:
        check_iceberg(iceberg, schema, o.output, key, o.overwrite, so)
    models = shared.Shared()
    # the worker runs in this process: it takes the model loaded above, through the handle it is given
    loaded = shared_model(models, spec, model) if local and workers == 1 else None
    # stateful mode embeds sentences whole (windows are not consecutive sentences): longer than the window is dead
    limit, flag = o.max_sentence_tokens, "--max-sentence-tokens"
    if stateful and o.window_tokens < limit:
        limit, flag = o.window_tokens, "--window-tokens (--state stateful embeds sentences whole)"
    upsert = Upsert.plan(iceberg, settings_salt(spec.key_prefix, limit, o.max_document_tokens), o.delete_missing,
                         so) if o.iceberg_mode == "upsert" else None
    model_entry = redact({"name": model_name, **identity, "tokenization": tokenization, "tokenizer": tokenizer,
                          **({"urls": model_urls(model_name)} if is_published(model_name) else {})})
    sections = {"compute_support": compute_support_here(o.compute_dtype, o.device) if local else None}
    if sentences_independent(o.state):      # vectors a function of the tokens: each shard's keys (docs/reuse.md)
        sections["key_index"] = manifests.key_index_section(spec.key_prefix)
    if dedupe:     # counts: sentences embedded and deduplicated (output/manifest.py complete)
        sections["dedupe"] = {"scope": "run", "exact": o.batch_invariant}
    if reuse:      # counts: sentences reused, by source (output/manifest.py complete)
        sections["reuse"] = {"sources": [s.label for s in reuse], "formats": [s.format for s in reuse],
                             "key_prefix": spec.key_prefix}
    manifest = manifests.planned(model_entry, columns, hdf5_layout(selection, n_layers), flags, formats,
                                 redact(files), key, sections)
    shard = ShardSpec(tuple(formats), o.parquet_layout, tuple(columns),
                      selection if selection == "average" else tuple(selection), o.duplicate_layer0, o.dtype,
                      o.row_group_bytes, n_layers, dim, o.vector_compression,
                      spec.key_prefix if sentences_independent(o.state) else None)
    children = tokenizer_processes(o.tokenizer_process, tokenizer, local,
                                   opts.view_as(StandardOptions).runner or "FnApiRunner", workers)
    return Plan(o, so, files, labels, formats, spec, shard,
                spread_documents=spread,
                unique_ids=bool(o.id_field) and not stateful, sort=sentences_independent(o.state),
                sentence_limit=limit, limit_flag=flag, window=0 if stateful else o.window_tokens,
                progress=ProgressSpec(sum(f[1] or 0 for f in fingerprints), {f[0]: f[1] or 0 for f in fingerprints},
                                      workers) if o.progress == "on" or (o.progress == "auto" and local and
                                                                         sys.stderr.isatty()) else None,
                key=key, ingredients=ingredients, manifest=manifest, tokenizer=tokenizer,
                tokenizer_processes=children,
                embed_threads=embed_threads(o.embed_threads or 0, threads, local, o.state, workers, children),
                iceberg=iceberg, upsert=upsert, schema=schema, models=models, loaded=loaded, dedupe=dedupe,
                fingerprints={f[0]: f[1:] for f in fingerprints},
                splits=splits, split_bytes=split, spread_buckets=buckets, reuse=reuse)


def compute_support_here(compute_dtype: str, device: str) -> dict:
    """The manifest's `compute_support`: how this machine (a local runner's workers run here) runs the biLM in
    the compute dtype on the device the workers pick (model.hardware.compute_support; no GPU is claimed)."""
    from elmo_pipeline.model.device import resolve_device
    from elmo_pipeline.model.hardware import compute_support
    return compute_support(compute_dtype, resolve_device(device))


def check_upsert(o: ElmoOptions, iceberg: IcebergTarget | None) -> None:
    """ValueError for --iceberg-mode upsert / --delete-missing / --reuse-table flags that cannot work: upsert (and
    --reuse-table) needs a table; upsert needs ids stable across runs (--id-field: default ids number lines, which
    shift when a line is inserted) and documents embedded independently of each other (not --state stateful)."""
    if o.delete_missing and o.iceberg_mode != "upsert":
        raise ValueError("--delete-missing needs --iceberg-mode upsert")
    if o.reuse_table and iceberg is None:
        raise ValueError("--reuse-table needs --iceberg-table NS.TABLE (and --iceberg-catalog): it reuses the "
                         "outputs registered there")
    if o.iceberg_mode != "upsert":
        return
    if iceberg is None:
        raise ValueError("--iceberg-mode upsert needs --iceberg-table NS.TABLE (and --iceberg-catalog)")
    if not o.id_field or o.input_format not in ("jsonl", "parquet"):
        raise ValueError("--iceberg-mode upsert needs --input-format jsonl or parquet with --id-field (JSONL or Parquet input with ids stable from one run "
                         "to the next; default ids number lines, which shift when a line is inserted)")
    if o.state == "stateful":
        raise ValueError("--iceberg-mode upsert needs --state stateless or warm (stateful vectors depend on the "
                         "documents before)")


def check_iceberg(iceberg: IcebergTarget, schema, output: str, key: str, overwrite: bool, so: dict) -> None:
    """Before a run with --iceberg-table: the catalog answers, an existing table takes this run's shards, and
    the table points at no files under --output that this run would replace (--overwrite, or an output that
    no longer holds the finished run registered from it): refused, since the table would then point at
    replaced files; so are a catalog or warehouse inside --output, and a partitioned table. Reads only."""
    iceberg.check_outside(output)
    held = iceberg.check(schema, output, so)
    if held and (overwrite or not finalize_started(output, key, so)):
        why = ("--overwrite would replace them" if overwrite else
               "it no longer holds the finished run of this command registered from it")
        raise ValueError(f"--iceberg-table {iceberg.table} already references Parquet files under {output} "
                         f"(snapshot {held[-1]}), and {why}: the table would point at replaced files. Write to a "
                         "new --output, or remove those files from the table first")


def pipeline_options(argv: list[str]) -> PipelineOptions:
    """The options of a command line, checked (unknown flags and bad values: ValueError, one line, before anything
    runs); the local default runner is FnApiRunner."""
    argv = list(argv)
    if not any(a == "--runner" or a.startswith("--runner=") for a in argv):
        argv.append("--runner=FnApiRunner")
    if any("DaskRunner" in a for a in argv):
        import apache_beam.runners.dask.dask_runner  # noqa: F401 - its options (--dask_client_address, ...)
    from elmo_pipeline.pipeline.validate import check_flags
    check_flags(argv)
    return PipelineOptions(argv)
