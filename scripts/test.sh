#!/usr/bin/env bash
# Set up whatever is missing, lint, then run the whole test suite against the real server.
# Extra arguments go to pytest (e.g. scripts/test.sh -k launcher).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
