#!/usr/bin/env bash
# Install the field's LLM benchmark tools (NVIDIA genai-perf 0.0.8 + perf_analyzer 2.51) into their
# own .venv-bench, leaving the project's pinned .venv alone; idempotent (stamp file) and fast when
# nothing changed. Usage: scripts/setup_bench_tools.sh; then `source scripts/bench_tool_env.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv-bench
TOOLS=$ROOT/.cache/tools
UV_VERSION=0.7.3

log() { printf '[setup-bench] %s\n' "$*" >&2; }

# perf_analyzer (shipped in the tritonclient 2.51 wheel) and genai-perf, plus the pins that keep
# them working here: numpy<2 (tritonclient/genai-perf), plotly 5 + kaleido 0.2.1 (kaleido 1.x needs
# a Chrome download for --generate-plots), libcudart.so.12 for perf_analyzer; the rest are the
# versions this set was verified with.
PACKAGES=(
  "genai-perf==0.0.8"
  "tritonclient[all]==2.51.0"
  "nvidia-cuda-runtime-cu12==12.9.79"
  "numpy==1.26.4"
  "pandas==3.0.6"
  "plotly==5.24.1"
  "kaleido==0.2.1"
  "transformers==5.24.0"
  "tokenizers==0.23.3"
  "protobuf==4.25.9"
  "grpcio==1.85.3"
)

# 1. perf_analyzer links libb64.so.0d (Debian's libb64-0d).
if ! dpkg -s libb64-0d >/dev/null 2>&1; then
  SUDO=; [[ $(id -u) -eq 0 ]] || SUDO=sudo
  log "installing Debian package libb64-0d"
  $SUDO apt-get install -y --no-install-recommends libb64-0d >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y --no-install-recommends libb64-0d >/dev/null; }
fi

PYTHON=${PYTHON:-$(command -v python3.11 || true)}
[[ -n "$PYTHON" ]] || { log "python3.11 is required"; exit 1; }

# uv: the machine's if present, else the private copy that scripts/setup.sh also uses.
UV=$(command -v uv || true)
if [[ -z "$UV" ]]; then
  UV=$TOOLS/bin/uv
  if [[ ! -x "$UV" ]]; then
    log "installing uv $UV_VERSION into $TOOLS"
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  fi
fi

# 2. The venv; an unchanged stamp (this script + uv version) means nothing to install.
STAMP=$( { echo "$UV_VERSION"; cat scripts/setup_bench_tools.sh; } | sha256sum | cut -d' ' -f1)
if [[ -f "$VENV/.setup-stamp" && "$(cat "$VENV/.setup-stamp")" == "$STAMP" ]]; then
  log ".venv-bench is up to date"
else
  [[ -x "$VENV/bin/python" ]] || "$UV" venv --quiet --python "$PYTHON" "$VENV"
  log "installing genai-perf 0.0.8, tritonclient 2.51.0 (perf_analyzer) and the CUDA runtime"
  VIRTUAL_ENV=$VENV "$UV" pip install --quiet "${PACKAGES[@]}"
  rm -f "$VENV/.setup-stamp"
fi

# 3. Verify both tools start with the environment that bench_tool_env.sh sets up.
# shellcheck source=scripts/bench_tool_env.sh
source scripts/bench_tool_env.sh
pa_version=$(perf_analyzer --version 2>&1 || true)
[[ $pa_version == *"Perf Analyzer Version 2.51"* ]] \
  || { log "perf_analyzer does not run: $pa_version"; ldd "$VENV/bin/perf_analyzer" | grep 'not found' >&2; exit 1; }
gp_version=$(genai-perf --version 2>&1 || true)
[[ $gp_version == "genai-perf 0.0.8" ]] || { log "genai-perf does not run: $gp_version"; exit 1; }
"$VENV/bin/python" -c 'import genai_perf.main, genai_perf.plots.plot_manager, tritonclient.grpc' \
  || { log "genai-perf modules do not import"; exit 1; }
echo "$STAMP" > "$VENV/.setup-stamp"

log "ready: $pa_version, $gp_version"
log "to use them: source scripts/bench_tool_env.sh   # sets:"
echo "export PATH=$VENV/bin:\$PATH"
echo "export LD_LIBRARY_PATH=$(echo "$VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
