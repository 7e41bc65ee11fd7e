"""Apache Iceberg tables an output is registered in (--iceberg-table). No Beam import; pyiceberg is an optional
extra (pip install 'elmo-pipeline[iceberg]'), imported only when a table is named.

- table.py: the target (IcebergTarget: catalog, table, its checks before a run), an output's data file URLs,
  the tables an output records (recorded_tables), --overwrite of a registered output.
- commit.py: the one commit of a finished output (commit(): retries, "already registered", the registration
  property), the id and partition checks it runs, and every use of pyiceberg's private names.
- upsert.py: --iceberg-mode upsert: change-only runs whose commit adds shards and position deletes.
"""
from elmo_pipeline.formats.iceberg.commit import DuplicateIdError, Registration
from elmo_pipeline.formats.iceberg.table import (MANIFEST_ENTRY, IcebergTarget, IcebergUnavailable, check_overwrite,
                                                 data_file_urls, output_url, recorded_tables)

__all__ = ["DuplicateIdError", "IcebergTarget", "IcebergUnavailable", "MANIFEST_ENTRY", "Registration",
           "check_overwrite", "data_file_urls", "output_url", "recorded_tables"]
