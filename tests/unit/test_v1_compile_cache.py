"""engine_v1/cpu_compile_cache.py: vLLM's AOT compile off for CPU engines, unless the operator says."""

from __future__ import annotations

from triton_vllm_multistep.engine_v1.cpu_compile_cache import AOT_COMPILE_ENV, use_loadable_compile_cache


def test_the_aot_path_is_turned_off_where_nothing_says_otherwise() -> None:
    environment: dict[str, str] = {}
    assert use_loadable_compile_cache(environment) is True
    assert environment == {AOT_COMPILE_ENV: "0"}


def test_an_operators_own_setting_wins() -> None:
    environment = {AOT_COMPILE_ENV: "1"}
    assert use_loadable_compile_cache(environment) is False
    assert environment == {AOT_COMPILE_ENV: "1"}
