"""`python -m elmo_pipeline.pipeline.run`: corpus in, per-layer ELMo vectors out (Parquet + HDF5), on any Beam runner.

run(): plan() settles what varies with the options, reading only (pipeline/plan.py); the run takes the output's
lease, runs the graph (pipeline/graph.py), which only stages data under <out>/_staging/<run key>/, and
finalizes from what is staged (pipeline/execute.py). main() is the command line: one summary line, or one
`error: ...` line and an exit status (pipeline/exits.py), and --metrics-file.
The local default runner is FnApiRunner (never Prism, which Beam would try to download).
"""
from __future__ import annotations

if __name__ == "__main__":    # the command's process: this module imported (seconds) and run under cli.process()
    from elmo_pipeline.pipeline.cli import process
    process(lambda: __import__("elmo_pipeline.pipeline.run", fromlist=["main"]).main())

import logging
import sys
import time

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, SetupOptions

from elmo_pipeline.output.names import METRICS
from elmo_pipeline.formats.layout import read_manifest, recorded_files
from elmo_pipeline.fsio import atomic_write, read_recorded, redact, redact_logs, url_fs
from elmo_pipeline.pipeline.execute import AlreadyComplete, FinalizeOnly, run_planned
from elmo_pipeline.pipeline.options import ElmoOptions, JobOptions
from elmo_pipeline.pipeline.validate import check_metrics_file
from elmo_pipeline.pipeline.plan import pipeline_options, plan, storage_options
from elmo_pipeline.pipeline.streams import one_line, say, stderr_is_terminal
from elmo_pipeline.transforms.logs import quiet_failures
from elmo_pipeline.transforms import progress


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
        result = run_planned(opts, pl)
    finally:
        progress.close()     # this process's bar (a local run's only worker runs here)
    result.elapsed_seconds = time.perf_counter() - t0
    result.iceberg = pl.registration
    return result


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
    dedupe = (f" ({n['sentences_embedded']} embedded, {n['sentences_deduplicated']} deduplicated"
              + (f", {n['sentences_reused']} reused" if "sentences_reused" in n else "") + ")"
              if "sentences_deduplicated" in n else "")
    changes = (f" ({n['documents_unchanged']} unchanged, {n['documents_changed']} changed, {n['documents_added']} "
               f"added, {n['documents_removed']} removed)" if "documents_unchanged" in n else "")  # upsert
    return (f"elmo-pipeline: {n.get('documents', 0)} documents{changes}, {n.get('sentences', 0)} sentences{dedupe}, "
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
    from elmo_pipeline.formats.metrics import render, status_families
    fs, local = url_fs(path)
    atomic_write(fs, local, (manifest_metrics + render(status_families(output or "", status, time.time()))).encode())


def _output_metrics(output: str, so: dict | None = None) -> str:
    """The output's metrics.prom, read back as the file its manifest records (fsio.read_recorded: size and SHA-256,
    at most its size + 1 read, a local FIFO never opened): NotTheRecordedFile for a file changed or placed since."""
    fs, root = url_fs(output, so)
    manifest = read_manifest(fs, root)
    if manifest is None:
        return ""
    try:
        return read_recorded(fs, root.rstrip("/") + "/" + METRICS,
                             (recorded_files(manifest) or {}).get(METRICS)).decode("utf-8")
    except FileNotFoundError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """The command: one summary line and exit 0, or one line `error: ...` and the exit status of
    pipeline/exits.py (the traceback too with --verbose)."""
    from elmo_pipeline.pipeline import exits
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    redact_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        import argparse
        parser = argparse.ArgumentParser(prog="python -m elmo_pipeline.pipeline.run",
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
            from elmo_pipeline.pipeline.dry_run import dry_run
            text = redact(dry_run(argv))
        else:
            result = run(argv)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure ends in one line and a status
        failure = exits.classify(e)
        if job.metrics_file and not job.dry_run:       # the result first: what is printed may reach nobody
            _try_metrics_file(job.metrics_file, job.output, failure.status)
        if job.verbose:
            import traceback
            say(redact("".join(traceback.format_exception(e))).rstrip("\n"))
        say(failure.line())
        return failure.status
    if job.dry_run:
        try:
            say(text, sys.stdout)
        except OSError as e:            # the plan is this command's product: a full disk is its failure
            failure = exits.classify(e)
            say(failure.line())
            return failure.status
        return exits.OK
    if job.metrics_file:
        _try_metrics_file(job.metrics_file, job.output, exits.OK,
                          lambda: _output_metrics(job.output, storage_options(PipelineOptions(argv))))
    say(("\n" if stderr_is_terminal() else "") + one_line(redact(summary(result, job.output))))
    return exits.OK


def _try_metrics_file(path: str, output: str | None, status: int, text=lambda: "") -> None:
    """--metrics-file with the exit status (and text(): the output's metrics, read back); a failure here is one
    warning line: the run's result and exit status stand, the collector file is an extra. Never inside the output
    (check_metrics_file: the run was refused), nor over a file it did not write."""
    try:
        check_metrics_file(path, output)
        try:
            counts = text()
        except Exception as e:  # noqa: BLE001 - the output's metrics left out, the exit status still written
            say(one_line(redact(f"warning: --metrics-file {path}: the output's metrics are left out: {e}")))
            counts = ""
        write_metrics_file(path, output, status, counts)
    except Exception as e:  # noqa: BLE001
        say(one_line(redact(f"warning: --metrics-file {path}: {e}")))
