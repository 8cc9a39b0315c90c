"""`vllm serve`'s command line from engine arguments (testing/vllm_serve.py), as the tests' reference
and the benchmark's peers start it."""

from __future__ import annotations

from triton_vllm_multistep.testing.vllm_serve import serve_arguments


def test_engine_arguments_become_vllm_serves_flags() -> None:
    values = {
        "model": "/models/tiny",  # given as --model by the caller
        "max_model_len": 1024,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "seed": None,
        "dtype": "float32",
        "override_generation_config": {"temperature": 0.5},
    }
    assert serve_arguments(values) == [
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--dtype",
        "float32",
        "--override-generation-config",
        '{"temperature": 0.5}',
    ]
