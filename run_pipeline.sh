#!/usr/bin/env bash
# Run the Beam pipeline (python -m elmo_pipeline.pipeline.run) with the same flags; bootstraps .venv first.
# With no arguments: the shipped default model on samples/sample.txt, output in out/sample/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# a failed set-up is one error line and 70 (docs/failure-behaviour.md#exit-statuses), never pip's own status (2 reads
# as a bad command line)
if ! scripts/bootstrap.sh; then
  echo "error: could not set up .venv (scripts/bootstrap.sh failed: its output is above) (exit 70: failed)" >&2
  exit 70
fi
if [[ $# -gt 0 ]]; then
  exec .venv/bin/python -m elmo_pipeline.pipeline.run "$@"
fi
if ! .venv/bin/python -c "from elmo_pipeline.model.pretrained import default_model_files; default_model_files()" 2>/dev/null; then
  echo "error: the shipped default model (model/pretrained/wikitext2-small) is not in this checkout;" >&2
  echo "       pass --options-file F --weight-file F and --input/--output to run on your own model." >&2
  exit 2
fi
out=out/sample
.venv/bin/python -m elmo_pipeline.pipeline.run --input samples/sample.txt --output "$out" --overwrite
cat <<MSG
Output: $out/  (manifest.json, parquet/, hdf5/)
Query it:
  .venv/bin/python -c "import duckdb; print(duckdb.sql(\"SELECT id, tokens[1:5] AS first_tokens, len(layer_2) AS n FROM '$out/parquet/*.parquet' ORDER BY id\"))"
  .venv/bin/python -c "import pyarrow.dataset as ds; print(ds.dataset('$out/parquet').to_table(columns=['id', 'tokens']))"
  .venv/bin/python -c "import h5py, glob; f = h5py.File(sorted(glob.glob('$out/hdf5/*.hdf5'))[0]); print({k: f[k].shape for k in f})"
MSG
