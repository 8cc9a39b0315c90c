"""The engine process's messages (engine/process.py) are plain values: every message type, both ways,
unpickles and pickles again in a Python that refuses to import vLLM, torch and numpy, and comes back
equal; so nothing of vLLM's, torch's or numpy's crosses the stub-engine boundary (the engine may run
under another Python with another vLLM).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import typing
from multiprocessing.reduction import ForkingPickler
from typing import Any

from triton_vllm_multistep.engine import process
from triton_vllm_multistep.engine.events import (
    Completion,
    EngineBuildError,
    EngineDied,
    EngineFacts,
    EngineOutput,
    EngineRequest,
    KvCacheStats,
    RequestFailed,
    RequestTimes,
    StepOutputs,
    TokenLogprob,
)

# Runs in the child: imports of vLLM, torch or numpy raise; unpickle stdin, check, pickle it back.
_ROUND_TRIP = """
import pickle, sys

REFUSED = ("vllm", "torch", "numpy")


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ImportError(f"{name} may not be imported here")
        return None


sys.meta_path.insert(0, Refuse())
messages = pickle.loads(sys.stdin.buffer.read())
loaded = sorted(name for name in sys.modules if name.split(".")[0] in REFUSED)
assert not loaded, loaded
sys.stdout.buffer.write(pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL))
"""


def _messages() -> list[Any]:
    facts = EngineFacts(
        model="demo/tiny",
        vocab_size=100,
        max_model_len=256,
        multimodal=True,
        num_scheduler_steps=8,
        attention_kernels="PyTorch SDPA",
        max_loras=2,
        images_per_prompt=1,
        tasks=("embed",),
    )
    completion = Completion(
        1,
        " world",
        [7, 8],
        -1.5,
        [{7: TokenLogprob(-0.5, 1, "a"), 3: TokenLogprob(-2.0, 2, "b")}, {8: TokenLogprob(-1.0, 1, None)}],
        "stop",
        "\n",
    )
    return [
        # stub → engine process
        process.EngineSpec(
            {"model": "demo/tiny", "dtype": "float32", "limit_mm_per_prompt": {"image": 2}},
            "step",
            user_threads={"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": None},
            use_ipex=False,
            cpus=(2, 3),
            lora_adapters=(("alpha", 1, "/adapters/alpha"),),
        ),
        EngineRequest(
            "req-1",
            (1, 5, 9),
            {
                "temperature": 0.5,
                "n": 2,
                "best_of": 3,
                "seed": 2**63 - 1,
                "stop": ["\n"],
                "logit_bias": {"5": 1.5},
                "guided_decoding": {"json": {"type": "object"}, "backend": "xgrammar"},
                "output_kind": "DELTA",
            },
            ("alpha", 1, "/adapters/alpha"),
            (b"\x89PNG\r\n\x1a\n...", b"GIF89a..."),
        ),
        EngineRequest("req-2", (3,)),
        # An embedding request: pooling fields, a text the engine tokenizes, a priority.
        EngineRequest("embed-1", (), prompt_text="hello", priority=-1, pooling={"dimensions": 8}),
        process.Abort("req-1"),
        process.Serve(0.25, True, True),
        process.Stop(),
        # engine process → stub
        process.Built(facts, 3),
        process.BuildFailed("OutOfMemoryError: out of memory\nTraceback ..."),
        StepOutputs(
            [
                EngineOutput("req-1", [completion, Completion(0, "", [])], False, 12, 1700000000.25),
                EngineOutput(
                    "req-2",
                    [Completion(0, "!", [9], finish_reason="length")],
                    True,
                    times=RequestTimes(1700000000.25, 1700000000.5, None, None, 32),
                ),
            ],
            0.004,
            finished_at=123.5,
            forward_seconds=0.003,
            forward_end=123.4,
            new_window=True,
            unreturned={"req-2": (10, 1)},
        ),
        StepOutputs([EngineOutput("embed-1", [], True, 4, embedding=[0.25, -0.5, 1e-08])], 0.001),
        RequestFailed("req-3", "the image prompt cannot be processed: ValueError: no placeholder"),
        EngineDied("vLLM engine failed: RuntimeError: boom", ["req-1", "req-2"]),
        KvCacheStats(10, 16, 1, 0, 0.5, "alpha", "alpha,beta"),
        process.Stopped(),
    ]


def _round_trip(messages: list[Any]) -> list[Any]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP],
        input=bytes(ForkingPickler.dumps(messages)),  # as Connection.send pickles
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    return pickle.loads(done.stdout)


def test_every_message_type_crosses_where_vllm_torch_and_numpy_cannot_load_and_comes_back_equal() -> None:
    messages = _messages()
    kinds = {type(message) for message in messages}
    assert kinds == set(typing.get_args(process.ToEngine)) | set(typing.get_args(process.FromEngine))
    assert _round_trip(messages) == messages


def test_a_build_failure_crosses_as_its_exception_where_that_needs_no_vllm_and_as_text_otherwise() -> None:
    class ForeignError(Exception):
        """As an exception class of vLLM's or torch's: its module would have to load in the stub."""

    failures = []
    for error in (EngineBuildError("pipeline_parallel_size must be 1"), ValueError("bad"), ForeignError("boom")):
        try:
            raise error
        except Exception as raised:
            failures.append(process.build_failure(raised))
    build_error, value_error, foreign = _round_trip(failures)
    assert type(build_error.error) is EngineBuildError and build_error.error.args == (
        "pipeline_parallel_size must be 1",
    )
    assert type(value_error.error) is ValueError and value_error.error.args == ("bad",)
    assert isinstance(foreign.error, str) and foreign.error.startswith("ForeignError: boom\nTraceback")
