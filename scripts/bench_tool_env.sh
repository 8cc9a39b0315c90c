# Source this (bash) to use the benchmark tools that scripts/setup_bench_tools.sh put in .venv-bench:
#   source scripts/bench_tool_env.sh && genai-perf profile ... && perf_analyzer ...
# genai-perf starts `perf_analyzer` by name, so .venv-bench/bin must be on PATH; perf_analyzer links
# libcudart.so.12 (even on a CPU host), which the nvidia-cuda-runtime-cu12 wheel ships.
_bench_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_VENV=$_bench_root/.venv-bench
_bench_cudart=$(echo "$BENCH_VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)
if [[ ! -x "$BENCH_VENV/bin/genai-perf" || ! -e "$_bench_cudart/libcudart.so.12" ]]; then
  echo "bench_tool_env: $BENCH_VENV is incomplete; run scripts/setup_bench_tools.sh" >&2
else
  case ":$PATH:" in *":$BENCH_VENV/bin:"*) ;; *) export PATH=$BENCH_VENV/bin:$PATH ;; esac
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$_bench_cudart:"*) ;;
    *) export LD_LIBRARY_PATH=$_bench_cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ;;
  esac
  export BENCH_VENV
fi
unset _bench_root _bench_cudart
