#!/usr/bin/env bash
# Bootstrap .venv if needed, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
