"""Checks run before the pipeline is built: a bad command line fails in a second with one line naming the
problem (pipeline.run.main prints it and exits 2, or 65 for bad model files: pipeline/exits.py), before Beam starts and before --output is touched.

The other subcommands' parser (OneLineParser) and the argparse types of train, evaluate and export (at_least, finite,
local_path) refuse a bad flag the same way, as their command line is parsed."""
from __future__ import annotations

import argparse
import math
import os
import posixpath
import re
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from elmo_pipeline.formats.iceberg import IcebergTarget
    from elmo_pipeline.pipeline.options import ElmoOptions


def _raising_parser():
    """Beam's argument parser, raising ValueError instead of printing usage and exiting (Beam imported here only:
    the `elmo` command's checks below do without it)."""
    from apache_beam.options.pipeline_options import _BeamArgumentParser

    class RaisingParser(_BeamArgumentParser):
        def error(self, message):
            raise ValueError(message)
    return RaisingParser(allow_abbrev=False, add_help=False)


def _option_classes() -> list[type]:
    from apache_beam.options.pipeline_options import PipelineOptions
    seen, todo = {}, list(PipelineOptions.__subclasses__())
    while todo:
        cls = todo.pop()
        if str(cls) not in seen:
            seen[str(cls)] = cls
            todo += cls.__subclasses__()
    return list(seen.values())


def check_flags(argv: list[str]) -> None:
    """ValueError for an unknown flag (Beam would only log "Discarding unparseable args" and run on without
    it) or a bad flag value (Beam's parser would print its whole usage and exit)."""
    import elmo_pipeline.pipeline.options  # noqa: F401 - registers ElmoOptions
    parser = _raising_parser()
    for cls in _option_classes():
        try:
            cls._add_argparse_args(parser)  # noqa: SLF001
        except Exception:  # noqa: BLE001 - an option class that clashes is Beam's business, not ours
            continue
    _, unknown = parser.parse_known_args(argv)
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    if flags:
        raise ValueError(f"unknown flag(s): {' '.join(flags)} (see python -m elmo_pipeline.pipeline.run --help)")
    if unknown:
        raise ValueError(f"unexpected argument(s): {' '.join(unknown)} (flags take the form --name value)")


def check_runner(opts) -> None:
    """ValueError, one line, for a --runner Beam cannot make (a name it does not know) or a negative
    --direct_num_workers (opts: Beam's PipelineOptions), before the output is touched."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions
    from apache_beam.runners.runner import create_runner
    name = opts.view_as(StandardOptions).runner or "FnApiRunner"
    try:
        create_runner(name)
    except (ValueError, ImportError, AttributeError) as e:
        raise ValueError(f"--runner {name}: {' '.join(str(e).split())}") from None
    workers = opts.view_as(DirectOptions).direct_num_workers
    if workers is not None and workers < 0:
        raise ValueError(f"--direct_num_workers must be >= 0 (0: one a core), got {workers}")
    if workers is not None and workers > MAX_THREADS:
        raise ValueError(f"--direct_num_workers must be at most {MAX_THREADS} (worker processes), got {workers}")


POSITIVE = ("max_sentence_tokens", "max_tokens_per_batch", "sort_buffer", "row_group_bytes", "shard_sentences",
            "shard_bytes", "window_tokens", "lease_stale_seconds", "max_record_bytes", "max_document_tokens",
            "s3_max_attempts")
MAX_THREADS = 1024      # threads or worker processes of one kind: more than any machine's cores
MAXIMA = {"lease_stale_seconds": (7 * 24 * 3600, "a week"), "torch_threads": (MAX_THREADS, "threads"),
          "embed_threads": (MAX_THREADS, "threads")}
# a float flag is in POSITIVE or MAXIMA (or both): it must also be a finite number


def check_numbers(o) -> None:
    """ValueError for a non-positive budget or size, a float flag that is not a finite number, a value over its
    MAXIMA, a negative thread count, or a window that cannot advance. Fills in the default --window-overlap."""
    for name in (*POSITIVE, *MAXIMA):
        v = getattr(o, name, None)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {v}")
    for name in POSITIVE:
        v = getattr(o, name, None)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name, (most, what) in MAXIMA.items():
        v = getattr(o, name, None)
        if v is not None and v > most:
            raise ValueError(f"--{name.replace('_', '-')} must be at most {most} ({what}), got {v}")
    if o.embed_threads is not None and o.embed_threads < 0:
        raise ValueError(f"--embed-threads must be >= 0 (0: automatic), got {o.embed_threads}")
    if (o.embed_threads or 0) > 1 and o.state == "stateful":
        raise ValueError("--embed-threads > 1 needs --state stateless or warm (stateful carries each batch's state "
                         "into the next)")
    if o.split_bytes < -1:
        raise ValueError(f"--split-bytes must be >= -1 (0: automatic, -1: whole files), got {o.split_bytes}")
    if o.torch_threads is not None and o.torch_threads < 0:
        raise ValueError(f"--torch-threads must be >= 0 (0: automatic), got {o.torch_threads}")
    o.window_overlap = check_windows(o.window_tokens, o.window_overlap, o.max_tokens_per_batch)


def check_windows(window_tokens: int, window_overlap: int | None, max_tokens: int) -> int:
    """The window overlap to use (the default when None) for windows of `window_tokens` under a batch budget;
    ValueError for windows that cannot advance. Shared by `run` and `elmo`."""
    from elmo_pipeline.model.windows import check_window, default_overlap
    if window_overlap is None:
        window_overlap = default_overlap(window_tokens) if window_tokens > 0 else 0
    check_window(window_tokens, window_overlap, max_tokens)
    return window_overlap


def check_state(state: str, *, workers: int = 1, budget_batches: bool = False, windows: bool = False,
                batch_invariant: bool | None = None) -> bool:
    """The rules of --state stateful (AllenNLP/bilm-tf behaviour: each batch row carries its LSTM state to
    the next batch, so batches are consecutive input sentences): one worker, no length-sorted token-budget
    batches, no windows (windows are not consecutive sentences), no --batch-invariant. Shared by `run` and
    `elmo`. Returns --batch-invariant as a bool (off unless asked for)."""
    if state != "stateful":
        return bool(batch_invariant)
    if batch_invariant:
        raise ValueError("--batch-invariant needs --state stateless or warm (stateful vectors depend on the "
                         "batches by design)")
    if workers > 1:
        raise ValueError("--state stateful keeps input order in consecutive batches: run it with one worker")
    if budget_batches:
        raise ValueError("--max-tokens-per-batch needs --state stateless or warm (stateful batches are "
                         "consecutive sentences)")
    if windows:
        raise ValueError("--window-tokens needs --state stateless or warm (stateful carries state between "
                         "consecutive sentences, windows are not sentences)")
    return False


def check_dedupe(flag: str, state: str, batch_invariant: bool) -> bool:
    """--dedupe resolved: auto is on where a sentence's vectors are a function of its tokens down to the bit
    (--batch-invariant, stateless or warm), so a copy is what the sentence would have been embedded as; on
    also without --batch-invariant (a copy then equals its own embedding to float32 round-off, like two batch
    budgets do); ValueError with stateful, where a sentence's vectors depend on the sentences before it."""
    if flag == "on" and state == "stateful":
        raise ValueError("--dedupe on needs --state stateless or warm (a stateful sentence's vectors depend on "
                         "the sentences before it)")
    return flag == "on" or flag == "auto" and batch_invariant and state != "stateful"


def check_reuse(sources: list[str] | None, state: str, output: str, table: bool = False) -> None:
    """--reuse (and --reuse-table: `table`) needs --state stateless or warm (a stateful sentence's vectors depend on
    the sentences before it, so no key names them) and sources outside --output (a run may clear or replace what
    lies there)."""
    if not sources and not table:
        return
    from elmo_pipeline.fsio import redact
    if state == "stateful":
        raise ValueError(f"{'--reuse' if sources else '--reuse-table'} needs --state stateless or warm (a stateful "
                         "sentence's vectors depend on the sentences before it, so no sentence key names them)")
    for s in sources or ():
        try:
            check_inputs_outside_output([s], output)
        except ValueError:
            raise ValueError(f"--reuse {redact(s)} lies inside --output {redact(output)}: a run may clear or "
                             "replace what it reads there") from None


def check_model(options_file: str, weight_file: str, build: bool):
    """A bad options.json or weights file (truncated, missing datasets, wrong shapes, non-finite values, options out
    of their schema's bounds or not matching the weights) fails now with OptionsError/WeightsError, not in every
    worker: checked without building the biLM (model.weights.check_bilm). With `build` (a local run's
    in-process worker takes it: transforms.embed.shared_model), the biLM loaded here and returned; else None."""
    from elmo_pipeline.model.weights import check_bilm, load_bilm
    if build:
        return load_bilm(options_file, weight_file)
    check_bilm(options_file, weight_file)
    return None


def check_output_writable(output: str, storage_options: dict | None = None) -> None:
    """PermissionError/ValueError when --output cannot be written. Local: the folder (or its nearest existing
    parent) must be a writable folder; nothing is created. Object stores: a probe object is written and removed."""
    if "://" not in output or output.startswith("file://"):
        path = os.path.abspath(output[len("file://"):] if output.startswith("file://") else output)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--output {output} is a file, not a folder")
        parent = path
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.exists(parent):          # a symbolic link to nothing: no folder can be made through it
            raise ValueError(f"--output {output}: {parent} is a symbolic link to {os.readlink(parent)}, which does "
                             "not exist")
        if not os.path.isdir(parent):
            raise ValueError(f"--output {output}: {parent} is a file, so the folder cannot be created")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"--output {output}: {parent} is not writable")
        return
    from elmo_pipeline.output.ownership import probe_writable
    probe_writable(output, storage_options)


def check_input_columns(files: list[str], input_format: str, text_field: str, id_field: str | None,
                        storage_options: dict | None = None) -> None:
    """ValueError naming the first Parquet input without the --text-field or --id-field column, and the columns
    it has (read from each file's footer), so a wrong field fails before anything is staged. A file whose
    footer cannot be read is left to the run, where it is a dead letter "unreadable file"."""
    if input_format != "parquet":
        return
    from elmo_pipeline.transforms.ids import printable_label
    from elmo_pipeline.transforms.read import parquet_columns
    wanted = [("--text-field", text_field)] + ([("--id-field", id_field)] if id_field else [])
    for url in files:
        try:
            names = parquet_columns(url, storage_options)
        except Exception:  # noqa: BLE001 - the reader reports it, for this file alone
            continue
        for flag, column in wanted:
            if column not in names:
                raise ValueError(f"{flag} {column!r}: the Parquet input {printable_label(url)} has no such column "
                                 f"(its columns: {', '.join(names) or 'none'})")
def _place(url: str) -> str:
    """Where a path or URL points: local paths resolved (symbolic links, '..'), URLs by scheme and path."""
    if "://" in url and not url.startswith("file://"):
        scheme, path = url.split("://", 1)
        return f"{scheme}://{path.rstrip('/')}"
    return os.path.realpath(url[len("file://"):] if url.startswith("file://") else url)


def _inside(files: list[str], output: str) -> list[str]:
    out = _place(output)
    return [f for f in files if _place(f) == out or _place(f).startswith(out.rstrip("/") + "/")]


def _is_pattern(p: str) -> bool:
    """Whether an --input is a glob (a URL's query string is no pattern: a presigned URL is one file)."""
    path = p.split("?", 1)[0] if "://" in p and not p.startswith("file://") else p
    return any(c in path for c in "*?[")


def inputs_outside_output(files: list[str], patterns: list[str], output: str,
                          own: Callable[[], set[str]] = lambda: set()) -> list[str]:
    """The input files but the output's own files a glob matched (`own()`: their places, as _place gives them:
    its dead letters under `corpus/**/*.jsonl` with `--output corpus/emb`), so the same command on a finished
    output is `already complete`. Any other file inside --output, or one an --input names literally, is refused
    (check_inputs_outside_output); a glob left with no file: ValueError."""
    named = {_place(p) for p in patterns if not _is_pattern(p)}
    inside = set(_inside(files, output))
    ours = own() if inside else set()
    check_inputs_outside_output([f for f in inside if _place(f) in named or _place(f) not in ours], output)
    kept = [f for f in files if f not in inside]
    if not kept:
        raise ValueError(f"--input matches only files inside --output {output} (its own files are never inputs)")
    return kept


def own_files(output: str, storage_options: dict | None = None) -> set[str]:
    """Where the files of `output` lie that the pipeline can show it wrote (output.ownership.owned_final_names, and
    everything under _staging/), as _place names them."""
    from elmo_pipeline.fsio import url_fs
    from elmo_pipeline.output.ownership import owned_final_names
    from elmo_pipeline.output.names import STAGING
    fs, root = url_fs(output, storage_options)
    staging = posixpath.join(root, STAGING)
    names = owned_final_names(fs, root) | {posixpath.relpath(p, root) for p in
                                           (fs.find(staging) if fs.isdir(staging) else [])}
    return {_place(output.rstrip("/") + "/" + n) for n in names}


def check_inputs_outside_output(files: list[str], output: str) -> None:
    """ValueError when an input file lies inside --output (a run may clear or replace what it reads there).
    Local paths are compared resolved (symbolic links, '..'); URLs by scheme and path."""
    inside = _inside(files, output)
    if inside:
        more = f" and {len(inside) - 1} more" if len(inside) > 1 else ""
        raise ValueError(f"--input {inside[0]}{more} lies inside --output {output}: a run may clear or replace "
                         "what it reads there. Write to another --output, or move the input out first")


def check_storage_options(so: dict) -> None:
    """ValueError for an --s3_endpoint_url that carries user info (http://user:password@host): S3 clients sign with
    the keys instead and refuse such a URL on the first request (an HTTP client's error, exit 70, after planning)."""
    endpoint = str((so.get("s3") or {}).get("endpoint_url") or "")
    if "@" in endpoint.split("://", 1)[-1].split("/", 1)[0]:
        from elmo_pipeline.fsio import redact
        raise ValueError(f"--s3_endpoint_url {redact(endpoint)}: credentials in the URL are not used by S3 clients; "
                         "give the host alone and pass --s3_access_key_id and --s3_secret_access_key")


METRICS_MARK = b"# HELP elmo_pipeline_"     # how every --metrics-file this command writes begins (formats/metrics.py)


def check_utf8_name(flag: str, value: str) -> None:
    """ValueError when a path flag's value is not UTF-8 (bytes Python holds as lone surrogates): the manifest, the
    commit records and the metrics name --output in UTF-8, so such a run failed after all its work (exit 70)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{flag} {value!r}: the name is not UTF-8 (the output's records name it in UTF-8); "
                         "rename it") from None


def check_metrics_file(path: str | None, output: str | None) -> None:
    """ValueError when --metrics-file is no local path (a URL was written without the run's storage options: to
    another store than the run's, or nowhere, after all the work), lies inside --output (written after Finalize,
    it would replace the output's own files, its manifest.json, metrics.prom, or add one its manifest does not
    record), or names a file this command did not write (another exporter's .prom, the run's input, ...: not empty
    and not beginning as ours do), which it would replace."""
    if path and "://" in path and not path.startswith("file://"):
        from elmo_pipeline.fsio import redact
        raise ValueError(f"--metrics-file {redact(path)}: a local file (node_exporter's textfile collector reads a "
                         "folder of its own machine), not a URL")
    if path and output and _inside([path], output):
        raise ValueError(f"--metrics-file {path} lies inside --output {output}: it would replace or add to the "
                         "output's own files; write it elsewhere (e.g. node_exporter's textfile collector folder)")
    if path and not _ours_or_absent(path[len("file://"):] if path.startswith("file://") else path):
        raise ValueError(f"--metrics-file {path}: a file this command did not write is there (it would be replaced); "
                         "name a file of its own (e.g. elmo_pipeline.prom in the collector's folder)")


def _ours_or_absent(path: str) -> bool:
    """Whether `path` holds no regular file, an empty one, or one beginning as a --metrics-file does (its first
    bytes read, a FIFO never opened)."""
    import stat
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return True         # nothing there (or unreadable: the write says what fails)
    try:
        head = os.read(fd, len(METRICS_MARK))
    finally:
        os.close(fd)
    return not head or head == METRICS_MARK


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
    no longer holds the finished run registered from it whole: output.state.keeps_final_files): refused, since
    the table would then point at replaced files; so are a catalog or warehouse inside --output, and a
    partitioned table. Reads only."""
    from elmo_pipeline.output.state import keeps_final_files
    iceberg.check_outside(output)
    held = iceberg.check(schema, output, so)
    if held and (overwrite or not keeps_final_files(output, key, so)):
        why = ("--overwrite would replace them" if overwrite else
               "it no longer holds the finished run of this command registered from it whole (a file it lists is "
               "gone or changed, or it is another command's), so this run would start over")
        raise ValueError(f"--iceberg-table {iceberg.table} already references Parquet files under {output} "
                         f"(snapshot {held[-1]}), and {why}: the table would point at replaced files. Write to a "
                         "new --output, or remove those files from the table first")


# --- the other subcommands' flags (train, evaluate, export): argparse types, checked as the command line is parsed

def at_least(minimum: int, meaning: str = "") -> Callable[[str], int]:
    """An argparse type: an int >= minimum (`meaning`: what the minimum means, e.g. '0: off'), else one line."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{f' ({meaning})' if meaning else ''}, got {value}")
        return value
    return parse


def finite(low: float, high: float | None = None, low_open: bool = False, high_open: bool = True,
           meaning: str = "") -> Callable[[str], float]:
    """An argparse type: a finite float in [low, high] (low_open / high_open: that end excluded), else one line."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        if value < low or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g}"
                                             f"{f' ({meaning})' if meaning else ''}, got {value:g}")
        if high is not None and (value > high or (high_open and value == high)):
            raise argparse.ArgumentTypeError(f"must be {'<' if high_open else '<='} {high:g}, got {value:g}")
        return value
    return parse


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(::[A-Za-z][A-Za-z0-9+.-]*)*://")


def local_path(what: str) -> Callable[[str], str]:
    """An argparse type for an output these commands write locally only (`what`: 'folder' or 'file'): a URL
    (`scheme://`, file:// too) is one line, redacted, before anything is created (os.makedirs made folders
    named after it: `s3:`, its key and signature)."""
    def parse(text: str) -> str:
        if _SCHEME.match(text):
            from elmo_pipeline.fsio import redact
            raise argparse.ArgumentTypeError(f"a local {what} path, not a URL (this command writes local files "
                                             f"only): {redact(text)}")
        return text
    return parse


class OneLineParser(argparse.ArgumentParser):
    """A subcommand's parser: a bad command line is one line `error: ...` (redacted), exit 2, without the usage."""

    def error(self, message):
        from elmo_pipeline.fsio import redact
        self.exit(2, f"error: {redact(' '.join(message.split()))} (see `{self.prog} --help`)\n")
