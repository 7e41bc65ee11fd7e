#!/usr/bin/env bash
# Bootstrap .venv if needed, then run the tests on pytest-xdist workers. Extra arguments go to pytest.
#   ./run_tests.sh                      the whole suite, as CI does (.ci/run)
#   ./run_tests.sh -m "not slow"        the fast tier, all day while developing (no process, server or cluster)
#   ./run_tests.sh -m slow              only the slow tier: worker processes, SIGKILL, moto S3, Dask, torchrun
#   ./run_tests.sh tests/test_x.py -k name -n 0     one file, in this process (-n 0: no workers, for pdb/-s)
# ELMO_TEST_WORKERS sets the worker count (default 2; 0 runs in this process). pytest's own help:
# .venv/bin/python -m pytest --help
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,8p' run_tests.sh | cut -c3-; exit 0; fi
scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -n "${ELMO_TEST_WORKERS:-2}" "$@"
