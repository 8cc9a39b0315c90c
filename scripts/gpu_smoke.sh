#!/usr/bin/env bash
# GPU smoke test of the vllm_multistep engine path (see docs/gpu.md): builds the engine from the
# shipped model folder and config as the backend does, streams, cancels, idles, and reports what
# vLLM runs (attention backend, CUDA graphs, async output processing). Needs a GPU host with the
# GPU environment (scripts/setup.sh --gpu, or the Docker image); refuses to run without a GPU.
# Usage: scripts/gpu_smoke.sh [--model-dir DIR] [--config FILE] [--model PATH] [--engine-args JSON]
#                             [--json REPORT] [--cpu] [--only engine|lora|image|v1]
#                             [--lora-adapters NAME=PATH,NAME=PATH] [--lora-transformers auto|on|off]
# --cpu runs the same checks on the CPU engine (CPU build of vLLM), as the test suite does.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[[ -x "$python" ]] || python=python3
export PYTHONPATH="$PWD/backend${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m triton_vllm_multistep.checks.gpu_smoke "$@"
