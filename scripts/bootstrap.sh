#!/usr/bin/env bash
# Create or update the project's virtualenv (.venv) with everything the job and the tests need.
# Idempotent: does nothing when setup.py and constraints.txt have not changed since the last run.
#   scripts/bootstrap.sh            -> .venv with the package (editable) and its test extras
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${ELMO_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.bootstrap-stamp"
want=$(cat setup.py constraints.txt | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then exit 0; fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first: otherwise pip may resolve the multi-GB CUDA build from the registry.
"${PIP[@]}" -c constraints.txt torch 2> >(grep -v "is ignored: it is neither" >&2)
"${PIP[@]}" -c constraints.txt -e ".[test]" 2> >(grep -v "is ignored: it is neither" >&2)
echo "$want" > "$stamp"
