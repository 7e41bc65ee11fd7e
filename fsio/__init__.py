"""Storage: local paths and fsspec URLs, one options shape ({protocol: {...}}), atomic writes, a model-file cache,
and redact(): secrets out of what is recorded or printed. No import of the project's other packages (everything else
imports this)."""
from elmo_pipeline.fsio.cache import (cache_dir, file_sha256, local_path, open_url, pinned_download, pinned_record,
                                      regular_file)
from elmo_pipeline.fsio.fs import (NotTheRecordedFile, atomic_write, bounded_lines, check_recorded, digest_of, expand, json_lines, json_or_none, read_json, same_digest, is_local_fs, is_local_url, keyed, makedirs,
                     move, only_a_file, open_file, place, options_for, protocol, read_recorded, release_written, remove_temp_files,
                     replacing, temp_name, held_temp, url_fs, storage_error, exception_chain, http_status,
                     transient_http, TRANSIENT_HTTP)
from elmo_pipeline.fsio.redact import redact, redact_logs

__all__ = ["NotTheRecordedFile", "bounded_lines", "read_recorded", "check_recorded", "digest_of", "json_lines", "json_or_none", "read_json", "same_digest", "atomic_write", "cache_dir", "expand", "file_sha256", "is_local_fs", "is_local_url", "keyed",
           "local_path", "makedirs", "move", "only_a_file", "open_file", "place", "open_url", "options_for", "pinned_download", "pinned_record", "regular_file",
           "protocol", "redact", "redact_logs", "release_written", "remove_temp_files", "replacing", "temp_name", "held_temp",
           "storage_error", "exception_chain", "http_status", "transient_http", "TRANSIENT_HTTP",
           "url_fs"]
