"""The same engine offline, in child processes: the throughput ceilings a served figure is compared with.

Owns the child process (one engine, measured on request over stdin/stdout) and the parent's handle
on the children (steps 1 and 8); must not start servers. Run as a child by `OfflineEngines`:
`python -m benchmarks.served.offline STEPS --max-tokens N --model REF`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.served.settings import KV_CACHE_GIB, ROOT, prompt, served_model_settings

ANSWER_MARK = "@@offline-engine@@ "


def offline_engine_process(steps: int, max_tokens: int, model: str) -> None:
    """Runs in a child process: one engine (the served model's settings at `steps`), measured on request.

    Reads JSON commands on stdin, one per line, and answers each with one JSON line on stdout:
    {"op": "generate", "threads": t, "batch": b} runs `LLM.generate` on `b` distinct prompts (the
    same prompts and settings as a served wave) with torch on `t` threads; {"op": "forward_only",
    "threads": t, "batch": b} measures step_timing's forward-only ceiling. Both answer {"tok_s": x}.
    """
    os.environ["VLLM_USE_V1"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
    import torch
    from vllm import LLM, SamplingParams
    from vllm.utils import Counter

    from triton_vllm_multistep.engine.engine_args import engine_values, to_engine_args
    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.testing.step_timing import forward_only_ceiling

    # All cores and all cores but one (what the served engine uses), unless the user chose a count.
    # Read before the build: vLLM's CPU platform sets OMP_NUM_THREADS while building.
    cores = torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else len(os.sched_getaffinity(0))
    thread_counts = sorted({cores, max(1, cores - 1)}, reverse=True)
    # Built to hand out once per window: LLM.generate reads only each request's last output.
    values = {**served_model_settings(steps, model).engine_args, "multi_step_stream_outputs": False}
    engine_args = to_engine_args(engine_values(values))
    engine = build_engine(engine_args, stream_mode="window")
    # LLM.generate itself, on this engine (LLM() would build vLLM's CPU engine, which has no multi-step).
    llm = LLM.__new__(LLM)
    llm.llm_engine = engine
    llm.engine_class = type(engine)
    llm.request_counter = Counter()
    llm.default_sampling_params = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    context_len = len(engine.get_tokenizer().encode(prompt(0))) + max_tokens // 2
    for threads in thread_counts:
        torch.set_num_threads(threads)
        llm.generate([prompt(i) for i in range(8)], params, use_tqdm=False)  # warm-up
    print(ANSWER_MARK + json.dumps({"thread_counts": thread_counts}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        torch.set_num_threads(command["threads"])
        batch = command["batch"]
        if command["op"] == "forward_only":
            value = forward_only_ceiling(engine, batch, context_len=context_len)
        else:
            prompts = [prompt(command.get("offset", 0) + i) for i in range(batch)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            value = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        print(ANSWER_MARK + json.dumps({"tok_s": value}), flush=True)
    engine.model_executor.shutdown()


def _keep_best(figures: dict[str, float], concurrency: int, value: float) -> None:
    figures[str(concurrency)] = max(figures.get(str(concurrency), 0.0), value)


class OfflineEngines:
    """The same engine offline (steps 1 and 8, one child process each), measured between served waves.

    Each figure is measured at the thread counts the child reports (all cores and all cores but
    one, see `serving_torch_threads` in engine/factory.py); per concurrency the best run is kept
    (as a served level keeps its best wave), and the ceiling is the best thread count.
    """

    STEPS = (1, 8)

    def __init__(self, max_tokens: int, model: str) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, VLLM_USE_V1="0")
        self._children: dict[int, subprocess.Popen] = {}
        self.thread_counts: list[int] = []
        for steps in self.STEPS:
            command = [sys.executable, "-m", "benchmarks.served.offline", str(steps)]
            command += ["--max-tokens", str(max_tokens), "--model", model]
            child = subprocess.Popen(
                command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            self._children[steps] = child
            self.thread_counts = self._answer(child)["thread_counts"]  # one at a time: builds do not overlap
        # steps → threads → concurrency → best tok/s, and threads → concurrency → forward-only
        self.generate: dict[str, dict[str, dict[str, float]]] = {
            str(s): {str(t): {} for t in self.thread_counts} for s in self.STEPS
        }
        self.forward_only: dict[str, dict[str, float]] = {str(t): {} for t in self.thread_counts}

    @staticmethod
    def _answer(child: subprocess.Popen) -> dict[str, Any]:
        while True:  # vLLM logs to stdout too: answers are the marked lines
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"offline engine process exited with {child.wait()}")
            if line.startswith(ANSWER_MARK):
                return json.loads(line[len(ANSWER_MARK) :])

    def _ask(self, steps: int, **command: Any) -> float:
        child = self._children[steps]
        child.stdin.write(json.dumps(command) + "\n")
        child.stdin.flush()
        return self._answer(child)["tok_s"]

    def measure_generate(self, concurrency: int, offset: int) -> None:
        """One LLM.generate per steps value and thread count, keeping the best per concurrency."""
        for steps in self.STEPS:
            for threads in self.thread_counts:
                value = self._ask(steps, op="generate", threads=threads, batch=concurrency, offset=offset)
                _keep_best(self.generate[str(steps)][str(threads)], concurrency, value)

    def measure_forward_only(self, concurrency: int) -> None:
        for threads in self.thread_counts:
            value = self._ask(8, op="forward_only", threads=threads, batch=concurrency)
            _keep_best(self.forward_only[str(threads)], concurrency, value)

    def results(self) -> dict[str, Any]:
        """In the shape `report.annotate` and the report read (also what --skip-offline reuses)."""
        concurrencies = list(next(iter(self.forward_only.values())))
        generate = {
            s: {c: max(by_threads[t][c] for t in by_threads) for c in concurrencies}
            for s, by_threads in self.generate.items()
        }
        for steps, by_threads in self.generate.items():
            for threads, figures in by_threads.items():
                for c in concurrencies:
                    print(f"offline LLM.generate steps={steps} threads={threads} batch={c}: {figures[c]:8.1f} tok/s")
        return {
            "llm_generate": generate,
            "llm_generate_by_threads": self.generate,
            "forward_only": {c: max(f[c] for f in self.forward_only.values()) for c in concurrencies},
            "forward_only_by_threads": self.forward_only,
            "torch_threads": self.thread_counts,
        }

    def close(self) -> None:
        for child in self._children.values():
            if child.poll() is None:
                child.stdin.close()
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description="One offline engine, measured on request (a benchmark child).")
    parser.add_argument("steps", type=int)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    offline_engine_process(args.steps, args.max_tokens, args.model)


if __name__ == "__main__":
    main()
