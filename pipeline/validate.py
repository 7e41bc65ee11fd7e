"""Checks run before the pipeline is built: a bad command line fails in a second with one line naming the
problem (pipeline.run.main prints it and exits 2), before Beam starts and before --output is touched."""
from __future__ import annotations

import os
import posixpath
import uuid

from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser


class _RaisingParser(_BeamArgumentParser):
    """Beam's argument parser, raising ValueError instead of printing usage and exiting."""

    def error(self, message):
        raise ValueError(message)


def _option_classes() -> list[type]:
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
    import pipeline.options  # noqa: F401 - registers ElmoOptions
    parser = _RaisingParser(allow_abbrev=False, add_help=False)
    for cls in _option_classes():
        try:
            cls._add_argparse_args(parser)  # noqa: SLF001
        except Exception:  # noqa: BLE001 - an option class that clashes is Beam's business, not ours
            continue
    _, unknown = parser.parse_known_args(argv)
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    if flags:
        raise ValueError(f"unknown flag(s): {' '.join(flags)} (see python -m pipeline.run --help)")
    if unknown:
        raise ValueError(f"unexpected argument(s): {' '.join(unknown)} (flags take the form --name value)")


POSITIVE = ("max_sentence_tokens", "max_tokens_per_batch", "sort_buffer", "row_group_bytes", "shard_sentences",
            "shard_bytes", "window_tokens")


def check_numbers(o) -> None:
    """ValueError for a non-positive budget or size, a negative thread count, or a window that cannot advance."""
    from model.windows import check_window
    for name in POSITIVE:
        v = getattr(o, name, None)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if o.torch_threads is not None and o.torch_threads < 0:
        raise ValueError(f"--torch-threads must be >= 0 (0: automatic), got {o.torch_threads}")
    from model.windows import default_overlap
    if o.window_overlap is None and o.window_tokens and o.window_tokens > 0:
        o.window_overlap = default_overlap(o.window_tokens)
    check_window(o.window_tokens, o.window_overlap if o.window_overlap is not None else 0, o.max_tokens_per_batch)


def check_model(options_file: str, weight_file: str):
    """Load the biLM once here: a bad options.json or weights file (truncated, missing datasets, wrong shapes,
    options that do not match the weights) fails now with OptionsError/WeightsError, not in every worker.
    Returns the loaded BiLM (a local run hands it to its in-process workers: transforms.embed.offer_model)."""
    from model.weights import load_bilm
    return load_bilm(options_file, weight_file)


def check_output_writable(output: str, storage_options: dict | None = None) -> None:
    """PermissionError/ValueError when --output cannot be written. Local: the folder (or its nearest existing
    parent) must be a writable folder; nothing is created. Object stores: a probe object is written and removed."""
    if "://" not in output or output.startswith("file://"):
        path = os.path.abspath(output[len("file://"):] if output.startswith("file://") else output)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--output {output} is a file, not a folder")
        parent = path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ValueError(f"--output {output}: {parent} is a file, so the folder cannot be created")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"--output {output}: {parent} is not writable")
        return
    from transforms.write import url_fs
    fs, root = url_fs(output, storage_options)
    probe = posixpath.join(root, f"_write_probe-{uuid.uuid4().hex}")
    try:
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001
        raise PermissionError(f"--output {output} is not writable: {type(e).__name__}: {e}") from None
