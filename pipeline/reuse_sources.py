"""--reuse's sources, opened and checked while planning (transforms/reuse.py joins and copies them on the workers).
No Beam import.

open_source: an earlier output's manifest, checked (it is untrusted) -> ReuseSource (what its shards are, where; its
kernel path against this run's: kernel_note);
table_sources: those of the outputs registered in the --iceberg-table (--reuse-table);
found_keys: which sentence keys the sources hold (`plan`'s estimate).
"""
from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass

import pyarrow as pa

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.parquet import KEY_INDEX_SCHEMA
from elmo_pipeline.formats.parquet_pages import open_checked
from elmo_pipeline.fsio import read_recorded, redact, url_fs
from elmo_pipeline.output.manifest import is_file_record
from elmo_pipeline.output.names import KEYS
from elmo_pipeline.transforms.reuse import (ROW_BITS, SHARD_BITS, ForeignSourceError, KernelPathError, ReuseError,
                                            ReuseSource, key_column)

logger = logging.getLogger("elmo-pipeline.reuse")
ACROSS_KERNELS = "--reuse-across-kernels"     # reuse a source computed on another kernel path (kernel_note)


@dataclass(frozen=True)
class Kernels:
    """This run's planned kernel path (model/kernels.py; None: not known while planning, a remote runner) and whether
    a source computed on another one is reused anyway (ACROSS_KERNELS given)."""
    here: dict | None
    across: bool = False


def _inside(rel) -> bool:
    return isinstance(rel, str) and rel and not rel.startswith("/") and "://" not in rel and \
        ".." not in rel.split("/")


def open_source(url: str, key_prefix: str, columns: list[tuple[str, int]], dtype: str,
                storage_options: dict | None = None, flag: str = "--reuse", kernels: Kernels | None = None
                ) -> ReuseSource:
    """The earlier output at `url`, checked: finished (manifest.json), a key index of this run's key prefix, the
    run's layer columns and dtype, Parquet (sentence layout) or Arrow shards to read vectors from, every shard's
    key index readable with as many rows as the shard. ReuseError naming it (redacted, after `flag`) otherwise;
    ForeignSourceError for another key prefix, layers or dtype; KernelPathError for another kernel path (kernel_note).
    """
    label = redact(url)
    try:
        fs, root = url_fs(url, storage_options)
        m = layout.read_manifest(fs, root)
    except Exception as e:  # noqa: BLE001 - reported as this source's problem
        raise ReuseError(f"{flag} {label}: cannot read it ({type(e).__name__}: {redact(str(e))})") from None
    if m is None:
        raise ReuseError(f"{flag} {label}: no finished output there (no manifest.json of this pipeline)")
    index = m.get("key_index")
    if not isinstance(index, dict) or not isinstance(index.get("key_prefix"), str):
        raise ReuseError(f"{flag} {label}: its manifest describes no key index (an output of --state stateful, "
                         "or of a version without one): nothing to join against")
    if index["key_prefix"] != key_prefix:
        raise ForeignSourceError(f"{flag} {label}: written by another model or other vector settings (key prefix "
                         f"{index['key_prefix']}, this run's {key_prefix}: docs/reuse.md): its vectors are not "
                         "this run's")
    if m.get("layer_dims") != dict(columns) or m.get("dtype") != dtype:
        raise ForeignSourceError(f"{flag} {label}: its layers {m.get('layer_dims')} ({m.get('dtype')}) are not this "
                         f"run's {dict(columns)} ({dtype})")
    note = kernel_note(layout.recorded_kernel_paths(m), label, flag, kernels)
    formats = [f for f in m.get("formats") or [] if isinstance(f, str)]
    fmt = "parquet" if "parquet" in formats and m.get("parquet_layout") == "sentence" else \
        "arrow" if "arrow" in formats else None
    if fmt is None:
        raise ReuseError(f"{flag} {label}: vectors are read back from Parquet (--parquet-layout sentence) or Arrow "
                         f"shards; it has {', '.join(formats) or 'none'}")
    try:
        files = layout.recorded_files(m)
    except ValueError as e:
        raise ReuseError(f"{flag} {label}: {e}") from None
    shards, records, tokens = [], [], []
    if len(m["shards"]) >= 1 << SHARD_BITS:
        raise ReuseError(f"{flag} {label}: more than {1 << SHARD_BITS} shards")
    for i, s in enumerate(m["shards"]):
        keys, data, n, t = (s.get(KEYS), s.get(fmt), s.get("sentences"), s.get("tokens")) if isinstance(s, dict) \
            else (None, None, None, None)
        if not (_inside(keys) and _inside(data) and isinstance(n, int) and 0 <= n < 1 << ROW_BITS and
                type(t) is int and t >= 0):
            raise ReuseError(f"{flag} {label}: its manifest's shard {i} is damaged ({redact(str(s))[:200]})")
        path = posixpath.join(root, keys)
        rec = (files.get(keys), files.get(data)) if files is not None else (None, None)
        if files is not None and not all(is_file_record(r) for r in rec):
            raise ReuseError(f"{flag} {label}: its manifest records no size and SHA-256 for shard {i}'s files "
                             f"({keys}, {data})")
        try:
            meta = open_checked(pa.BufferReader(read_recorded(fs, path, rec[0]))).metadata
            ok = meta.num_rows == n and meta.schema.to_arrow_schema().remove_metadata().equals(KEY_INDEX_SCHEMA)
        except Exception as e:  # noqa: BLE001
            raise ReuseError(f"{flag} {label}: its key index {keys} cannot be read ({type(e).__name__}: "
                             f"{redact(str(e))})") from None
        if not ok:
            raise ReuseError(f"{flag} {label}: its key index {keys} does not hold the {n} (id, key) rows of its "
                             "shard")
        shards.append((_url(url, keys), _url(url, data), n))
        records.append(rec)
        tokens.append(t)
    return ReuseSource(url, label, fmt, tuple(shards), tuple(records), note, tuple(tokens))


def kernel_note(source: list | None, label: str, flag: str, kernels: Kernels | None) -> str:
    """How the kernel paths a source was computed on (formats.layout.recorded_kernel_paths) compare with this run's:
    'same'; 'not recorded' (None: an output of an earlier version: reused, with a warning); 'not compared' (this
    run's is not known while planning); 'differs: <phrase>' where ACROSS_KERNELS accepts the difference (one of
    several paths differing is a difference; a damaged one, formats.layout.well_formed_kernel, too);
    KernelPathError otherwise."""
    from elmo_pipeline.model.kernels import kernel_difference
    if kernels is None or kernels.here is None:
        return "not compared"
    if source is None:
        logger.warning("%s %s: its manifest records no kernel path (an output of an earlier version): its vectors are "
                       "reused as if computed on this run's (docs/reuse.md#kernel-paths)", flag, label)
        return "not recorded"
    if not isinstance(source, list) or not source or not all(layout.well_formed_kernel(p) for p in source):
        differ = "a damaged kernel_path record"
    else:
        differ = next((d for p in source if (d := kernel_difference(p, kernels.here)) is not None), None)
        if differ is not None and len(source) > 1:
            differ = f"its workers computed on {len(source)} kernel paths; {differ}"
    if differ is None:
        return "same"
    if not kernels.across:
        raise KernelPathError(f"{flag} {label}: computed on another kernel path ({differ}, source vs this run): "
                              f"its vectors differ from this run's in the last bits; {ACROSS_KERNELS} reuses them "
                              "anyway (docs/reuse.md#kernel-paths)")
    return f"differs: {differ} ({ACROSS_KERNELS})"


def table_sources(table: str, urls: list[str], key_prefix: str, columns: list[tuple[str, int]], dtype: str,
                  skip: list[str], storage_options: dict | None = None, kernels: Kernels | None = None
                  ) -> list[ReuseSource]:
    """--reuse-table: the outputs registered in `table` (`urls`: formats.iceberg.registered_outputs), each opened
    as a --reuse source is (open_source). One of another model, settings or kernel path (a table may mix runs) is
    left out with a logged reason; so is one at or inside a URL of `skip` (--output, the --reuse sources).
    ReuseError for a missing or damaged one: the table references its files."""
    out = []
    for url in urls:
        if any(url == s or url.startswith(s + "/") for s in skip):
            continue
        try:
            out.append(open_source(url, key_prefix, columns, dtype, storage_options, f"--reuse-table ({table})",
                                   kernels))
        except ForeignSourceError as e:
            logger.warning("not reused: %s", e)
    return out


def _url(base: str, rel: str) -> str:
    return base.rstrip("/") + "/" + rel


def found_keys(sources: list[ReuseSource], keys: set[str], storage_options: dict | None = None) -> set[str]:
    """Which of `keys` (sentence keys) the sources' key indexes hold: every key-index file's key column read once
    (`plan`'s estimate; the run joins on the runner instead)."""
    import pyarrow.compute as pc
    wanted, found = pa.array(sorted(keys), pa.string()), set()
    for src in sources:
        for k, (path, _, rows) in enumerate(src.shards):
            record = src.records[k][0] if src.records else None
            col = key_column(path, record, rows, storage_options, ReuseError(
                f"--reuse {src.label}: its key index {redact(path)} holds values that are no sentence keys"))
            found.update(col.filter(pc.is_in(col, value_set=wanted)).to_pylist())
    return found
