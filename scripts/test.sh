#!/usr/bin/env bash
# Set up whatever is missing, lint, then run the whole test suite against the real server.
# Extra arguments go to pytest (e.g. scripts/test.sh -k launcher). The run ends with the time of
# each part: set-up and lint (measured here, handed to pytest) and each test tier. Tests run on two
# pytest-xdist workers (tests/scheduling.py: why, and what each gets); TRITON_VLLM_MULTISTEP_TEST_WORKERS
# sets another number (0: in this process, one test at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
scripts/setup.sh
export TRITON_VLLM_MULTISTEP_SETUP_SECONDS=$((SECONDS - started))
started=$SECONDS
.venv/bin/ruff check .
.venv/bin/lint-imports
export TRITON_VLLM_MULTISTEP_LINT_SECONDS=$((SECONDS - started))
exec .venv/bin/python -m pytest -n "${TRITON_VLLM_MULTISTEP_TEST_WORKERS:-2}" "$@"
