#!/usr/bin/env bash
# Re-resolve requirements/cpu.txt from cpu.in. --exclude-newer keeps every package at a
# release from before vLLM 0.8.5's successors (newer transformers/hub/numpy break it), so
# the same inputs always give the same pins.
set -euo pipefail
cd "$(dirname "$0")/../requirements"
UV=$(command -v uv || echo ../.cache/tools/bin/uv)
"$UV" pip compile cpu.in --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --exclude-newer 2025-05-10 -o cpu.txt
