"""How long building a structured-output constraint holds up a running stream (figures, not a test).

One engine loop (CPU multi-step runner, demo model), one unconstrained stream running; a JSON-schema
constraint is submitted and built by engine/constraints.py. Prints the stream's median step gap
before, and its longest gap while the constraint is built, per backend.

    .venv/bin/python -m benchmarks.constraint_build_stall [--backends xgrammar outlines ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from triton_vllm_multistep.testing.polling import wait_for


def measure(backend: str, model: str, fields: int) -> tuple[float, float, float]:
    from vllm import EngineArgs

    from triton_vllm_multistep.demo import models
    from triton_vllm_multistep.engine.events import EngineRequest
    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.loop import EngineLoop, StepOutputs

    args = EngineArgs(model=str(models.build(model)), dtype="float32", max_model_len=2048, num_scheduler_steps=8)
    loop = EngineLoop(lambda: build_engine(args, stream_mode="step"))
    loop.start_engine()
    times: list[float] = []
    constrained: list[float] = []

    def sink(event: object) -> None:
        if isinstance(event, StepOutputs):
            now = time.perf_counter()
            for output in event.outputs:
                (times if output.request_id == "plain" else constrained).append(now)

    loop.serve(sink)
    delta = "DELTA"
    plain = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0, "output_kind": delta}
    loop.submit(EngineRequest("plain", (1, 2, 3), plain))
    wait_for(lambda: len(times) >= 30, 300, interval=0.05)  # the stream runs steadily (a loaded host starts slowly)
    schema = {
        "type": "object",
        "properties": {f"f{i}": {"type": "string"} if i % 2 else {"type": "integer"} for i in range(fields)},
        "required": [f"f{i}" for i in range(fields)],
    }
    submitted = time.perf_counter()
    guided = {"json": schema, "backend": backend}
    loop.submit(EngineRequest("g", (1, 5, 9), {"max_tokens": 8, "guided_decoding": guided, "output_kind": delta}))
    wait_for(lambda: bool(constrained), 300, interval=0.05)
    built = constrained[0] - submitted
    count = len(times)
    wait_for(lambda: len(times) >= count + 20, 300, interval=0.05)
    loop.shutdown()
    gaps = list(itertools.pairwise(times))
    before = sorted(b - a for a, b in gaps if b < submitted)
    during = [b - a for a, b in gaps if b >= submitted]
    return before[len(before) // 2], max(during), built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "outlines", "lm-format-enforcer", "guidance"])
    parser.add_argument("--model", default="tiny-llama-bpe")
    parser.add_argument("--fields", type=int, default=12, help="properties of the JSON schema")
    args = parser.parse_args()
    for backend in args.backends:
        median, longest, built = measure(backend, args.model, args.fields)
        print(
            f"{backend:20s} median step gap {1000 * median:6.1f} ms, longest while building {1000 * longest:7.1f} ms, "
            f"submit to first constrained token {1000 * built:7.1f} ms"
        )


if __name__ == "__main__":
    main()
