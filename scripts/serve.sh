#!/usr/bin/env bash
# Set up whatever is missing, then serve model_repository/ with tritonserver
# (HTTP 8000, gRPC 8001, metrics 8002; any tritonserver flag may follow, e.g. --http-port=9000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/triton-vllm-multistep serve --model-repository model_repository "$@"
