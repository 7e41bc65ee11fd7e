"""Keep Apache Beam's import notices and INFO chatter off the terminal; its warnings and errors still show (its
failure tracebacks: transforms/logs.py).

Importing Beam without its GCP extras logs "apitools not found ..." on the root logger (a module-level
logging.warning), and a run logs INFO lines (type-hint conversions, BigQuery storage, state cache size)
on the apache_beam.* loggers; DaskRunner warns about its partition size on every run. quiet_beam() drops
those notices by their text and raises the apache_beam logger to WARNING. Call it before the first `import apache_beam`.
"""
from __future__ import annotations

import logging

BEAM_IMPORT_NOTICES = ("apitools not found",   # message prefixes, logged by Beam's own modules
                       "The new default partition size is")      # DaskRunner, on every run


class _DropBeamImportNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.WARNING and "apache_beam" in record.pathname
                    and isinstance(record.msg, str) and record.msg.startswith(BEAM_IMPORT_NOTICES))


_FILTER = _DropBeamImportNotices()


def quiet_beam() -> None:
    """Idempotent. The filter sits on the root logger itself, where Beam logs those notices."""
    logging.getLogger().addFilter(_FILTER)
    logging.getLogger("apache_beam.runners.dask.transform_evaluator").addFilter(_FILTER)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
