"""A finished output registered in an Iceberg table (--iceberg-table), from its manifest. No Beam import.

register() is Finalize's hook (output/finalize.py complete_finalize) and the way a finished output is added to
a table named by a later command: the table's commit (formats/iceberg/, or formats/iceberg/upsert.py for
--iceberg-mode upsert) runs its checks, then, just before the files are added, the output records the table in
its manifest (manifest.with_table): the output knows the table before the table knows it. That write goes
through a Sink fenced by the run's lease, as every other.
"""
from __future__ import annotations

import logging
from typing import Callable

from elmo_pipeline.output import manifest as manifests
from elmo_pipeline.output.sink import Sink
from elmo_pipeline.output.state import check_unchanged

logger = logging.getLogger("elmo-pipeline.run")


def register(output: str, manifest: dict, how, schema=None, storage_options: dict | None = None,
             fence: Callable[[], None] | None = None, verify: bool = False):
    """Register the finished `output` (its `manifest`) with `how` (formats.iceberg.IcebergTarget, or
    formats.iceberg.upsert.Upsert); returns its Registration, logged. `verify`: an output this process did not just
    finalize (a finished one found 'complete'): its listed files are checked against their records once the table is
    found not to hold it, before any is read (output.state.check_unchanged: a file changed or swapped since is never
    added; FileExistsError, exit 2)."""
    target = getattr(how, "target", how)

    def check_files():
        check_unchanged(output, manifest, storage_options, f"; nothing was added to Iceberg table {target.table}")

    def record():
        if manifests.with_table(manifest, target.table, target.catalog):
            sink, root = Sink.at(output, storage_options, fence)
            manifests.write(sink, root, manifest)
    registration = how.register(output, manifest, schema, storage_options, record,
                                check_files=check_files if verify else None)
    logger.info("%s", registration.describe())
    return registration
