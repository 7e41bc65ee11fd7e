"""What a run of `python -m elmo_pipeline.pipeline.run` does, settled from its options before anything runs: plan() checks the
options, the model (model/resolve.py) and --output, and returns a Plan, which the graph (pipeline/graph.py), the
run under the output's lease (pipeline/execute.py) and --dry-run (pipeline/dry_run.py) take. Reads only.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
from apache_beam.options.pipeline_options import PipelineOptions, S3Options
from apache_beam.utils import shared

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.hdf5 import hdf5_layout
from elmo_pipeline.formats.iceberg import IcebergTarget, check_overwrite, output_url
from elmo_pipeline.formats.iceberg.upsert import Upsert, settings_salt
from elmo_pipeline.formats.parquet import layer_columns, shard_schema
from elmo_pipeline.fsio import expand, redact, url_fs
from elmo_pipeline.model.options import load_options, sentences_independent
from elmo_pipeline.model.kernels import exact_here, planned_kernel_path
from elmo_pipeline.model.resolve import resolve_model
from elmo_pipeline.pipeline.options import ElmoOptions, JobOptions
from elmo_pipeline.pipeline.streams import stderr_is_terminal
from elmo_pipeline.pipeline.validate import (check_dedupe, check_iceberg, check_input_columns, check_metrics_file,
                                             check_model, check_numbers, check_output_writable, check_reuse,
                                             check_runner, check_state, check_storage_options, check_upsert,
                                             check_utf8_name, inputs_outside_output, own_files)
from elmo_pipeline.pipeline.workers import (BUCKET_BYTES, Where, dask_partitions, embed_threads, layout_of,
                                            spread_by_key, tokenizer_processes)
from elmo_pipeline.model.resolve import ModelSpec
from elmo_pipeline.transforms.embed import parse_layers
from elmo_pipeline.transforms.embed import shared_model
from elmo_pipeline.transforms.progress import ProgressSpec
from elmo_pipeline.pipeline.reuse_sources import Kernels, kernel_note, open_source, table_sources
from elmo_pipeline.transforms.reuse import ReuseSource
from elmo_pipeline.pipeline.read_plan import plan_splits, split_size
from elmo_pipeline.transforms.splits import Split
from elmo_pipeline.transforms.ids import file_labels, public_url
from elmo_pipeline.output.state import input_fingerprints, run_ingredients, run_key
from elmo_pipeline.output import manifest as manifests
from elmo_pipeline.output.lifecycle import Job
from elmo_pipeline.output.register import register
from elmo_pipeline.output.staging import ShardSpec

logger = logging.getLogger("elmo-pipeline.run")


def storage_options(opts: PipelineOptions) -> dict:
    """Storage options {protocol: {...}} from Beam's standard --s3_* flags (one config for both; --s3_session_token
    with the key of temporary credentials, --s3_verify, --s3_disable_ssl), plus botocore's retry policy from
    --s3-max-attempts."""
    s3 = opts.view_as(S3Options)
    so = {}
    if s3.s3_endpoint_url:
        so["endpoint_url"] = s3.s3_endpoint_url
    if s3.s3_access_key_id:
        so["key"], so["secret"] = s3.s3_access_key_id, s3.s3_secret_access_key
    if s3.s3_session_token:
        so["token"] = s3.s3_session_token
    if s3.s3_region_name:
        so["client_kwargs"] = {"region_name": s3.s3_region_name}
    if s3.s3_verify is not None:         # botocore's verify: False, or the CA bundle to verify with
        verify = str(s3.s3_verify)
        so.setdefault("client_kwargs", {})["verify"] = False if verify.lower() in ("false", "0", "no") else verify
    if s3.s3_disable_ssl:
        so["use_ssl"] = False
    attempts = opts.view_as(ElmoOptions).s3_max_attempts
    so["config_kwargs"] = {"retries": {"total_max_attempts": attempts, "mode": "standard"}}
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
    loaded: object = None          # the launcher's hold on it (transforms.embed.shared_model), local runs
    splits: list[Split] = field(default_factory=list)   # the read elements (transforms/splits.py); [] one per file
    split_bytes: int = 0           # --split-bytes resolved (0: whole files)
    fingerprints: dict = field(default_factory=dict)    # file URL -> [size, version] when planned: each read checks it
    spread_buckets: int = 0        # > 0: documents spread by a GroupByKey on a hash of their id into this many
                                   # buckets (runners whose Reshuffle moves nothing), else by a Reshuffle
    reuse: list[ReuseSource] = field(default_factory=list)   # --reuse sources, checked (pipeline/reuse_sources.py)

    def register(self, manifest: dict, fence: Callable[[], None] | None = None, verify: bool = False) -> None:
        """Finalize's hook (output/register.py): the finished output's shards into the Iceberg table, fenced by
        `fence` (the run's lease); `verify`: checked against their records first (a finished output found)."""
        self.registration = register(self.options.output, manifest, self.upsert if self.upsert is not None
                                     else self.iceberg, self.schema, self.storage_options, fence, verify)

    @property
    def registrar(self):
        return self.register if self.iceberg is not None else None

    def job(self) -> Job:
        """What the output's life needs of this plan (output/lifecycle.py)."""
        o = self.options
        return Job(o.output, self.key, self.ingredients, self.manifest, self.files, self.storage_options,
                   overwrite=o.overwrite, resumable=o.state != "stateful", lease_stale_seconds=o.lease_stale_seconds,
                   register=self.registrar, upsert=self.upsert, kernel_path=self.manifest.get("kernel_path"))


class Inputs(NamedTuple):
    """plan_inputs(): the input files and how they are read."""
    files: list[str]               # expanded, the output's own files left out
    labels: dict[str, str]         # file URL -> label in document ids
    fingerprints: list[list]       # [url, size, version] per file (output/state.py input_fingerprints)


class Model(NamedTuple):
    """plan_model(): the model and every setting that changes its vectors."""
    spec: ModelSpec                # pinned (what workers check, what the key prefix hashes)
    bilm: object                   # the BiLM loaded once here (a bad model fails here)
    name: str
    tokenization: str
    tokenizer: str
    selection: object              # --layers: "average" or a list of layer indices
    columns: list                  # [(column, width)]
    n_layers: int
    dim: int


class Extras(NamedTuple):
    """plan_extras(): the features a run may add: --reuse sources, --dedupe, the Iceberg table and its upsert."""
    reuse: list[ReuseSource]
    dedupe: bool
    iceberg: IcebergTarget | None
    schema: object                 # the shards' Arrow schema (with --iceberg-table)
    upsert: Upsert | None
    sentence_limit: int            # longer sentences are dead letters
    limit_flag: str                # the flag to name in their reason


def plan(opts: PipelineOptions, probe_output: bool = True) -> Plan:
    """Check the options, the model and --output, and settle what the graph does, in four parts: the inputs,
    the model, the extras (reuse, dedupe, Iceberg), the output (its checks, the run key, the manifest). Nothing
    is written under --output (on an object store, a probe object is written and removed: check_output_writable;
    not with probe_output=False, as for --dry-run, which checks only what it can read)."""
    o = opts.view_as(ElmoOptions)
    if not o.input or not o.output:
        raise ValueError("--input and --output are required")
    check_utf8_name("--output", o.output)
    check_numbers(o)
    check_metrics_file(opts.view_as(JobOptions).metrics_file, o.output)
    iceberg = IcebergTarget.from_flags(o.iceberg_table, o.iceberg_catalog, o.iceberg_warehouse, o.formats(), o.dtype)
    check_upsert(o, iceberg)
    so = storage_options(opts)
    check_storage_options(so)
    check_runner(opts)
    where = layout_of(opts, o)
    inputs = plan_inputs(o, so, iceberg)
    model = plan_model(o, so, where)
    if probe_output or "://" not in o.output or o.output.startswith("file://"):    # local: reads only
        check_output_writable(o.output, so)
    if o.overwrite:          # an output registered in a table this command does not name: refused
        check_overwrite(o.output, layout.read_manifest(*url_fs(o.output, so)), iceberg)
    extras = plan_extras(o, so, model, iceberg)
    key, ingredients, flags = run_identity(o, inputs, model)
    if iceberg:
        check_iceberg(iceberg, extras.schema, o.output, key, o.overwrite, so)
    if o.iceberg_mode == "upsert":        # the table's state, read once (read only)
        salt = settings_salt(model.spec.key_prefix, extras.sentence_limit, o.max_document_tokens)
        upsert = Upsert.plan(iceberg, salt, o.delete_missing, so)
        if upsert.state:        # the documents left unchanged keep rows computed on the table's kernel path
            upsert.kernel_note = kernel_note(upsert.kernel_path, f"Iceberg table {iceberg.table}",
                                             "--iceberg-mode upsert", Kernels(model.spec.kernel_path,
                                                                             o.reuse_across_kernels))
        extras = extras._replace(upsert=upsert)
    manifest = planned_manifest(o, model, inputs, extras, key, flags, where.local)
    return assemble(opts, o, so, where, inputs, model, extras, key, ingredients, manifest)


def plan_inputs(o: ElmoOptions, so: dict, iceberg: IcebergTarget | None) -> Inputs:
    """The input files (a glob leaves out the output's own files), their labels and fingerprints; ValueError for an
    output name a table's URLs cannot carry, or Parquet inputs without the named columns. Reads only."""
    if iceberg is not None and any(c in o.output.split("://", 1)[-1] for c in "#?"):
        raise ValueError(f"--iceberg-table: --output {redact(o.output)} holds '#' or '?', which a table's file URLs "
                         "cannot carry (read as a fragment or a query); write to a folder named without them")
    files = inputs_outside_output(expand(o.input, so), o.input, o.output, lambda: own_files(o.output, so))
    labels = file_labels(files, o.id_root, full=iceberg is not None and not o.id_field)
    check_input_columns(files, o.input_format, o.text_field, o.id_field, so)
    return Inputs(files, labels, input_fingerprints(files, so))


def plan_model(o: ElmoOptions, so: dict, where: Where) -> Model:
    """The model resolved and checked (loaded once here), the tokenizer, the layer selection and the ModelSpec with
    every setting that changes the vectors, pinned; --state/--batch-invariant and the device checked (on a local
    runner, or a device named)."""
    from elmo_pipeline.model.device import check_batch_invariant, resolve_device
    from elmo_pipeline.model.windows import effective_overlap, effective_window
    from elmo_pipeline.tokenization import resolve_tokenizer, tokenizer_version
    resolved = resolve_model(o.model, o.options_file, o.weight_file, o.vocab_file, so,
                             progress={"on": True, "off": False}.get(o.progress))
    tokenizer = resolve_tokenizer(o.tokenizer, resolved.tokenization)
    local_options, local_weights, _ = resolved.local_files()
    bilm_opts = load_options(local_options)
    n_layers, dim = bilm_opts.n_layers + 1, bilm_opts.output_dim
    selection = parse_layers(o.layers, n_layers)
    columns = layer_columns(selection, dim, o.duplicate_layer0)
    o.batch_invariant = check_state(o.state, workers=where.workers, batch_invariant=o.batch_invariant)   # resolved
    stateful = o.state == "stateful"
    windowed = not stateful and o.window_tokens
    spec = dataclasses.replace(
        resolved, device=o.device, state=o.state, torch_threads=where.threads, compute_dtype=o.compute_dtype,
        batch_invariant=o.batch_invariant, dtype=o.dtype, duplicate_layer0=o.duplicate_layer0,
        layers=selection if selection == "average" else ",".join(map(str, selection)),
        window=effective_window(o.window_tokens, o.max_tokens_per_batch) if windowed else 0,
        overlap=effective_overlap(o.window_tokens, o.window_overlap, o.max_tokens_per_batch) if windowed else 0,
        tokenizer=tokenizer, tokenizer_version=tokenizer_version(tokenizer))
    if where.local and o.device != "auto":   # fail fast on a missing GPU (without claiming one here)
        resolve_device(o.device)
    if o.batch_invariant and (where.local or o.device != "auto"):   # remote 'auto': each worker's embedder checks
        check_batch_invariant(o.device)
    # a bad model fails here, not in every worker; built only for a worker in this process
    bilm = check_model(local_options, local_weights, build=where.local and where.workers == 1)
    spec = dataclasses.replace(spec.pinned(), kernel_path=planned_kernel_path(spec, bilm, where.local))
    return Model(spec, bilm, resolved.name, resolved.tokenization, tokenizer, selection, columns,
                 n_layers, dim)


def plan_extras(o: ElmoOptions, so: dict, model: Model, iceberg: IcebergTarget | None) -> Extras:
    """--reuse / --reuse-table sources (opened and checked), --dedupe resolved, the shards' schema for the table,
    the sentence limit (the upsert, planned once the table is checked, mixes it into its hashes)."""
    dedupe = check_dedupe(o.dedupe, o.state, o.batch_invariant)
    check_reuse(o.reuse, o.state, o.output, o.reuse_table)
    prefix, kernels = model.spec.key_prefix, Kernels(model.spec.kernel_path, o.reuse_across_kernels)
    reuse = [open_source(s, prefix, model.columns, o.dtype, so, kernels=kernels) for s in o.reuse or ()]
    if o.reuse_table:        # the outputs registered in the table: sources too, unless foreign (logged)
        reuse += table_sources(iceberg.table, iceberg.registered_outputs(so), prefix, model.columns, o.dtype,
                               [output_url(u) for u in [o.output, *(o.reuse or ())]], so, kernels)
    if o.split_bytes > 0 and o.state == "stateful":
        raise ValueError("--split-bytes needs --state stateless or warm (stateful reads each file in order)")
    schema = shard_schema(o.parquet_layout, model.columns, o.dtype) if iceberg else None
    # stateful mode embeds sentences whole (windows are not consecutive sentences): longer than the window is dead
    limit, flag = o.max_sentence_tokens, "--max-sentence-tokens"
    if o.state == "stateful" and o.window_tokens < limit:
        limit, flag = o.window_tokens, "--window-tokens (--state stateful embeds sentences whole)"
    return Extras(reuse, dedupe, iceberg, schema, None, limit, flag)


def identity_of(o: ElmoOptions, spec: ModelSpec) -> dict:
    """The model's identity as the run key and the manifest record it."""
    return {**spec.identity(), "batch_invariant": o.batch_invariant}


def run_identity(o: ElmoOptions, inputs: Inputs, model: Model) -> tuple[str, dict, dict]:
    """(run key, what it hashes, the flags the manifest records: redacted) of the run (output/state.py)."""
    identity = identity_of(o, model.spec)
    flags = redact({k: getattr(o, k) for k in o._visible_option_list()})    # no secret in the manifest
    if o.id_root:
        flags["id_root"] = public_url(o.id_root)
    ingredients = run_ingredients(flags, redact(inputs.fingerprints), identity)   # as run.json records them
    if inputs.labels != file_labels(inputs.files):   # ids other than the default ones (--id-root itself is not in the key)
        ingredients["options"]["id_root"] = flags["id_root"] or "full paths (--iceberg-table)"
    if o.iceberg_mode == "upsert":        # only the changed documents are written: another output
        ingredients["options"].update(iceberg_mode=o.iceberg_mode, delete_missing=o.delete_missing)
    return run_key(ingredients), ingredients, flags


def planned_manifest(o: ElmoOptions, model: Model, inputs: Inputs, extras: Extras, key: str, flags: dict,
                     local: bool) -> dict:
    """manifest.json as known before the run (output/manifest.py planned), with the sections of the features used."""
    from elmo_pipeline.model.pretrained import is_published, model_urls
    spec = model.spec
    entry = redact({"name": model.name, **identity_of(o, spec), "tokenization": model.tokenization, "tokenizer": model.tokenizer,
                    **({"urls": model_urls(model.name)} if is_published(model.name) else {})})
    sections = {"compute_support": compute_support_here(o.compute_dtype, o.device) if local else None,
                "kernel_path": spec.kernel_path}     # what computes the vectors (model/kernels.py; None: remote)
    if sentences_independent(o.state):      # vectors a function of the tokens: each shard's keys (docs/reuse.md)
        sections["key_index"] = manifests.key_index_section(spec.key_prefix)
    if extras.dedupe:     # counts: sentences embedded and deduplicated (output/manifest.py complete)
        sections["dedupe"] = {"scope": "run", "exact": exact_here(spec.kernel_path, o.batch_invariant)}
    if extras.reuse:      # counts: sentences reused, by source (output/manifest.py complete)
        sections["reuse"] = {"sources": [s.label for s in extras.reuse], "formats": [s.format for s in extras.reuse],
                             "key_prefix": spec.key_prefix, "kernel_paths": [s.kernel_path for s in extras.reuse]}
    return manifests.planned(entry, model.columns, hdf5_layout(model.selection, model.n_layers), flags, o.formats(),
                             redact(inputs.files), key, sections)


def assemble(opts: PipelineOptions, o: ElmoOptions, so: dict, where: Where, inputs: Inputs, model: Model,
             extras: Extras, key: str, ingredients: dict, manifest: dict) -> Plan:
    """The Plan of the four parts: how the work is cut and spread, the shard spec, the workers' model handle."""
    stateful = o.state == "stateful"
    # a local runner materializes a Reshuffle in memory (peak RSS grew with the corpus:
    # benchmarks/pipeline_memory.py), so one local worker skips it; stateful keeps input order
    spread = not stateful and not (where.local and where.workers == 1)
    sizes = {f[0]: f[1] or 0 for f in inputs.fingerprints}       # auto: files are cut only where the work is spread
    split = split_size(o.split_bytes, sum(sizes.values())) if o.split_bytes > 0 or spread else 0
    splits = plan_splits(inputs.files, sizes, o.input_format, split, so)
    buckets = 0
    if spread_by_key(where.runner):
        partitions = dask_partitions(opts, len(splits)) if "DaskRunner" in where.runner else len(splits)
        buckets = max(4 * partitions, sum(sizes.values()) // BUCKET_BYTES)
    models = shared.Shared()
    # the worker runs in this process: it takes the model loaded above, through the handle it is given
    loaded = shared_model(models, model.spec, model.bilm) if where.local and where.workers == 1 else None
    selection = model.selection
    shard = ShardSpec(tuple(o.formats()), o.parquet_layout, tuple(model.columns),
                      selection if selection == "average" else tuple(selection), o.duplicate_layer0, o.dtype,
                      o.row_group_bytes, model.n_layers, model.dim, o.vector_compression,
                      model.spec.key_prefix if sentences_independent(o.state) else None)
    children = tokenizer_processes(o.tokenizer_process, model.tokenizer, where.local, where.runner, where.workers)
    bar = o.progress == "on" or (o.progress == "auto" and where.local and stderr_is_terminal())
    return Plan(o, so, inputs.files, inputs.labels, o.formats(), model.spec, shard,
                spread_documents=spread,
                unique_ids=bool(o.id_field) and not stateful, sort=sentences_independent(o.state),
                sentence_limit=extras.sentence_limit, limit_flag=extras.limit_flag,
                window=0 if stateful else o.window_tokens,
                progress=ProgressSpec(sum(sizes.values()), sizes, where.workers) if bar else None,
                key=key, ingredients=ingredients, manifest=manifest, tokenizer=model.tokenizer,
                tokenizer_processes=children,
                embed_threads=embed_threads(o.embed_threads or 0, where.threads, where.local, o.state, where.workers,
                                            children),
                iceberg=extras.iceberg, upsert=extras.upsert, schema=extras.schema, models=models, loaded=loaded,
                dedupe=extras.dedupe, fingerprints={f[0]: f[1:] for f in inputs.fingerprints},
                splits=splits, split_bytes=split, spread_buckets=buckets, reuse=extras.reuse)


def compute_support_here(compute_dtype: str, device: str) -> dict:
    """The manifest's `compute_support`: how this machine (a local runner's workers run here) runs the biLM in
    the compute dtype on the device the workers pick (model.hardware.compute_support; no GPU is claimed)."""
    from elmo_pipeline.model.device import resolve_device
    from elmo_pipeline.model.hardware import compute_support
    return compute_support(compute_dtype, resolve_device(device))


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
