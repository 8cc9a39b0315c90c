"""Drop-in compatibility with Triton's vLLM backend, the parts that need no engine and no server.

model.json field acceptance, config.pbtxt switches and their precedence, where sampling fields
come from, request refusals, and the metrics arithmetic on fake pb_utils (a shared registry, as
Triton's: instances of one model version write the same series).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from triton_vllm_multistep.engine import engine_args as vllm_args
from triton_vllm_multistep.engine.events import Completion, EngineOutput, KvCacheStats, RequestTimes, StepOutputs
from triton_vllm_multistep.settings import backend, parameters
from triton_vllm_multistep.stub import codec
from triton_vllm_multistep.stub.metrics import BackendMetrics, RequestTiming
from triton_vllm_multistep.stub.responder import RequestState, Responder

# EngineArgs field names these tests need (the real list comes from vLLM at load time).
ENGINE_FIELDS = {"model", "gpu_memory_utilization", "enforce_eager", "disable_log_stats", "num_scheduler_steps"}


def params(**values: str) -> dict[str, Any]:
    """A model config with config.pbtxt parameters, as Triton hands it to the stub."""
    return {"parameters": {key: {"string_value": value} for key, value in values.items()}}


# --- model.json --------------------------------------------------------------------------------


def test_their_sample_model_json_loads_and_disable_log_requests_is_ignored_with_a_log_line(caplog, monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger("triton_vllm_multistep"), "propagate", True)  # the stub's logger
    theirs = {"model": "m", "disable_log_requests": True, "gpu_memory_utilization": 0.5, "enforce_eager": True}
    with caplog.at_level(logging.INFO, logger="triton_vllm_multistep"):
        values = vllm_args.engine_fields(theirs, ENGINE_FIELDS)
    assert values == {"model": "m", "gpu_memory_utilization": 0.5, "enforce_eager": True}
    assert "'disable_log_requests' is ignored" in caplog.text


def test_unknown_model_json_fields_still_fail_naming_them() -> None:
    with pytest.raises(parameters.ConfigError, match="unknown vLLM engine argument.*disable_log_requestz, tempo"):
        vllm_args.engine_fields({"model": "m", "tempo": 1, "disable_log_requestz": True}, ENGINE_FIELDS)


# --- config.pbtxt switches ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "engine_json", "expected"),
    [
        ({}, {}, True),  # our default
        ({"REPORT_CUSTOM_METRICS": "true"}, {}, True),
        ({"REPORT_CUSTOM_METRICS": "TRUE"}, {}, True),
        ({"REPORT_CUSTOM_METRICS": "false"}, {}, False),
        ({"enable_metrics": "false"}, {}, False),
        ({"enable_metrics": "true", "REPORT_CUSTOM_METRICS": "true"}, {}, True),
        ({"REPORT_CUSTOM_METRICS": "true"}, {"disable_log_stats": True}, False),  # as theirs
        ({}, {"disable_log_stats": True}, False),
        ({"enable_metrics": "true"}, {"disable_log_stats": False}, True),
    ],
)
def test_metrics_switches(parameters: dict, engine_json: dict, expected: bool) -> None:
    assert backend.backend_settings(params(**parameters), engine_json).enable_metrics is expected


def test_disable_log_stats_winning_over_an_explicit_switch_is_logged(caplog, monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger("triton_vllm_multistep"), "propagate", True)  # the stub's logger
    with caplog.at_level(logging.WARNING, logger="triton_vllm_multistep"):
        settings = backend.backend_settings(params(REPORT_CUSTOM_METRICS="true"), {"disable_log_stats": True})
    assert not settings.enable_metrics
    assert "'disable_log_stats': true wins over config.pbtxt parameter REPORT_CUSTOM_METRICS=true" in caplog.text


def test_the_two_metrics_switches_disagreeing_is_a_load_error_naming_both() -> None:
    with pytest.raises(parameters.ConfigError, match="'enable_metrics'='true' and 'REPORT_CUSTOM_METRICS'='false'"):
        backend.backend_settings(params(enable_metrics="true", REPORT_CUSTOM_METRICS="false"), {})


def test_their_health_check_parameter_is_accepted_and_checked() -> None:
    assert backend.backend_settings(params(ENABLE_VLLM_HEALTH_CHECK="true"), {}).stream_mode == "step"
    with pytest.raises(parameters.ConfigError, match="ENABLE_VLLM_HEALTH_CHECK"):
        backend.backend_settings(params(ENABLE_VLLM_HEALTH_CHECK="maybe"), {})


@pytest.mark.parametrize(
    ("parameters", "engine_json", "mode"),
    [
        ({}, {}, "step"),
        ({}, {"multi_step_stream_outputs": False}, "window"),
        ({"stream_mode": "window"}, {}, "window"),
        ({"stream_mode": "step"}, {"multi_step_stream_outputs": True}, "step"),
        ({"stream_mode": "window"}, {"multi_step_stream_outputs": False}, "window"),
    ],
)
def test_stream_mode_follows_either_setting_when_they_agree(parameters: dict, engine_json: dict, mode: str) -> None:
    assert backend.backend_settings(params(**parameters), engine_json).stream_mode == mode


def test_stream_mode_and_multi_step_stream_outputs_disagreeing_is_a_load_error_naming_both() -> None:
    with pytest.raises(parameters.ConfigError) as raised:
        backend.backend_settings(params(stream_mode="step"), {"multi_step_stream_outputs": False})
    assert "'stream_mode'='step'" in str(raised.value)
    assert "'multi_step_stream_outputs'=false" in str(raised.value)


@pytest.mark.parametrize(
    ("groups", "gpus", "expected"),
    [
        ([{"count": 1, "kind": "KIND_MODEL"}], 0, 1),
        ([{"count": 2, "kind": "KIND_CPU"}], 0, 2),
        ([{"count": 1, "kind": "KIND_GPU"}], 2, 2),
        ([{"count": 2, "kind": "KIND_GPU", "gpus": [0]}], 4, 2),
    ],
)
def test_instance_count(groups: list, gpus: int, expected: int) -> None:
    assert backend.instance_count({"instance_group": groups}, gpus) == expected


# --- requests ----------------------------------------------------------------------------------


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_the_sampling_parameters_input_wins_and_request_parameters_are_then_not_sampling_fields() -> None:
    inputs = {"text_input": text("hi"), "sampling_parameters": text('{"max_tokens": 4}')}
    fields, source = codec.sampling_fields(inputs, '{"max_tokenz": 5, "temperature": 0}')
    assert (fields, source) == ({"max_tokens": 4}, "sampling_parameters")


def test_without_the_input_request_parameters_are_the_sampling_fields_named_as_parameters() -> None:
    fields, source = codec.sampling_fields({"text_input": text("hi")}, '{"max_tokens": 5, "sequence_id": 3}')
    assert (fields, source) == ({"max_tokens": 5}, "parameters")
    with pytest.raises(codec.RequestError, match=r"^parameters\.max_tokens: expected an integer"):
        codec.FIELD_CONVERTERS["max_tokens"]("parameters.max_tokens", "ten")


LIMITS = codec.ModelLimits(vocab_size=100, max_model_len=64, model_name="demo/tiny")


def decode(inputs: dict, limits: codec.ModelLimits = LIMITS) -> codec.GenerationRequest:
    return codec.decode_request(inputs, None, limits, encode=lambda s: [1, 2], decode=lambda ids: "x")


def test_an_image_for_a_text_only_model_is_refused_naming_the_input_in_vllms_words() -> None:
    with pytest.raises(codec.RequestError, match="input 'image': demo/tiny is not a multimodal model"):
        decode({"text_input": text("<image> what?"), "image": text("aGVsbG8=")})


def test_streaming_with_the_prompt_is_refused_in_their_words_whole_with_the_advice_for_the_log() -> None:
    flags = {"stream": np.array([True]), "exclude_input_in_output": np.array([False])}
    with pytest.raises(codec.RequestError) as raised:
        decode({"text_input": text("hi"), **flags})
    their_text = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    assert str(raised.value) == their_text
    assert raised.value.log_detail and "'exclude_input_in_output' to true" in raised.value.log_detail


# --- metrics -----------------------------------------------------------------------------------


class FakeMetric:
    def __init__(self, kind: str, buckets: list | None) -> None:
        self.kind = kind
        self.buckets = buckets
        self.value = 0.0
        self.observations: list[float] = []
        self.calls = 0

    def increment(self, value: float) -> None:
        assert self.kind != "COUNTER" or value >= 0, value
        self.calls += 1
        self.value += value

    def set(self, value: float) -> None:
        self.calls += 1
        self.value = value

    def observe(self, value: float) -> None:
        self.calls += 1
        self.observations.append(value)


class FakePbUtils:
    """pb_utils.MetricFamily over one registry: same name and labels = the same series, as in Triton."""

    def __init__(self) -> None:
        self.series: dict[tuple, FakeMetric] = {}
        registry = self.series

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

            def __init__(self, name: str, description: str, kind: str) -> None:
                self.name, self.kind = name, kind

            def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:
                key = (self.name, tuple(sorted(labels.items())))
                return registry.setdefault(key, FakeMetric(self.kind, buckets))

        self.MetricFamily = MetricFamily

    def value(self, name: str, **extra: str) -> float:
        labels = tuple(sorted({"model": "m", "version": "1", **extra}.items()))
        return self.series[(name, labels)].value

    def observations(self, name: str) -> list[float]:
        return self.series[(name, (("model", "m"), ("version", "1")))].observations

    def calls(self) -> int:
        return sum(metric.calls for metric in self.series.values())


def new_metrics(pb: FakePbUtils, instances: int = 1) -> BackendMetrics:
    return BackendMetrics(pb, "m", "1", max_model_len=1024, instances=instances)


def test_their_metrics_test_three_requests_of_sixteen_tokens_count_as_in_vllm() -> None:
    """Their test: 3 non-streamed requests (prompts of 6 tokens), 16 tokens each."""
    pb = FakePbUtils()
    metrics = new_metrics(pb)
    for index in range(3):
        timing = RequestTiming(arrival=100.0 + index, prompt_tokens=6, stream=False)
        metrics.on_response(timing, [(0, 16)], True, now=102.5 + index, engine_first_token=101.0 + index)
    metrics.flush()
    assert pb.value("vllm:prompt_tokens_total") == 18
    assert pb.value("vllm:generation_tokens_total") == 48
    assert len(pb.observations("vllm:time_to_first_token_seconds")) == 3
    assert pb.value("vllm:time_per_output_token_seconds_count") == 45
    assert pb.value("vllm:time_per_output_token_seconds_sum") == pytest.approx(3 * 1.5)  # first → last token
    assert pb.value("vllm:time_per_output_token_seconds_bucket", le="0.1") == 45  # 1.5 s / 15 gaps = 0.1 s
    assert pb.value("vllm:time_per_output_token_seconds_bucket", le="0.075") == 0
    assert sum(pb.observations("vllm:request_prompt_tokens")) == 18
    assert sum(pb.observations("vllm:request_generation_tokens")) == 48
    assert pb.observations("vllm:request_params_n") == [1, 1, 1]
    assert len(pb.observations("vllm:e2e_request_latency_seconds")) == 3


def test_streamed_tokens_are_observed_one_by_one_with_the_time_since_the_previous_token() -> None:
    pb = FakePbUtils()
    metrics = new_metrics(pb)
    timing = RequestTiming(arrival=0.0, prompt_tokens=3, stream=True, n=2)
    metrics.on_response(timing, [(0, 1), (1, 1)], False, now=0.5)  # first tokens: TTFT, no TPOT
    metrics.on_response(timing, [(0, 1), (1, 1)], False, now=0.52)
    metrics.on_response(timing, [(0, 1), (1, 0)], False, now=0.6)
    metrics.on_response(timing, [(1, 2)], True, now=1.0)  # two tokens at once share the interval
    metrics.flush()
    assert pb.value("vllm:time_per_output_token_seconds_count") == 5
    assert pb.value("vllm:time_per_output_token_seconds_bucket", le="0.025") == 2  # the two 0.02 s gaps
    assert pb.value("vllm:time_per_output_token_seconds_bucket", le="0.1") == 3  # + 0.08 s
    assert pb.value("vllm:time_per_output_token_seconds_bucket", le="0.2") == 3
    assert pb.value("vllm:time_per_output_token_seconds_bucket", le="0.3") == 5  # + 2 × 0.24 s
    assert pb.value("vllm:generation_tokens_total") == 7
    assert pb.observations("vllm:time_to_first_token_seconds") == [0.5]
    assert pb.observations("vllm:request_params_n") == [2]


def test_best_of_candidates_count_as_generated_tokens() -> None:
    pb = FakePbUtils()
    metrics = new_metrics(pb)
    timing = RequestTiming(arrival=0.0, prompt_tokens=4, stream=False, n=2)
    # n=2 returned (10 + 8 tokens), 2 more candidates generated 9 + 7 tokens.
    metrics.on_response(timing, [(0, 10), (1, 8)], True, now=2.0, engine_first_token=1.0, unreturned=(16, 2))
    metrics.flush()
    assert pb.value("vllm:generation_tokens_total") == 34
    assert pb.value("vllm:time_per_output_token_seconds_count") == 34 - 4  # every sequence's first token excluded
    assert pb.observations("vllm:request_generation_tokens") == [34]


def test_a_flush_pushes_everything_and_costs_calls_per_request_not_per_token() -> None:
    pb = FakePbUtils()
    metrics = new_metrics(pb)
    baseline = pb.calls()
    timing = RequestTiming(arrival=0.0, prompt_tokens=5, stream=True)
    for step in range(200):
        metrics.on_response(timing, [(0, 1)], step == 199, now=0.1 + step * 0.02)
    assert pb.value("vllm:generation_tokens_total") == 0  # nothing pushed before a flush
    metrics.flush()
    assert pb.value("vllm:generation_tokens_total") == 200
    assert pb.value("vllm:time_per_output_token_seconds_count") == 199
    assert pb.calls() - baseline < 40  # 200 tokens, one request: a few dozen calls at most


def test_the_engine_going_idle_triggers_a_flush_before_the_timer() -> None:
    pb = FakePbUtils()
    metrics = new_metrics(pb)
    metrics.maybe_flush(now=1000.0)
    metrics.update_engine_state(KvCacheStats(free_blocks=10, total_blocks=10, running=1, waiting=0))
    metrics.maybe_flush(now=1000.01)
    assert pb.value("vllm:num_requests_running") == 0  # busy state: waits for the timer
    metrics.update_engine_state(KvCacheStats(free_blocks=10, total_blocks=10, running=0, waiting=0))
    metrics.on_response(RequestTiming(0.0, 2, True), [(0, 3)], False, now=0.1)
    metrics.maybe_flush(now=1000.02)
    assert pb.value("vllm:generation_tokens_total") == 3


def test_two_instances_add_their_gauges_instead_of_overwriting_them() -> None:
    pb = FakePbUtils()
    first, second = new_metrics(pb, instances=2), new_metrics(pb, instances=2)
    first.update_engine_state(KvCacheStats(free_blocks=60, total_blocks=100, running=3, waiting=1))
    second.update_engine_state(KvCacheStats(free_blocks=100, total_blocks=100, running=0, waiting=2))
    first.flush()
    second.flush()
    assert pb.value("vllm:num_requests_running") == 3
    assert pb.value("vllm:num_requests_waiting") == 3
    assert pb.value("vllm_multistep:kv_cache_total_blocks") == 200
    assert pb.value("vllm:gpu_cache_usage_perc") == pytest.approx(0.2)  # mean of 0.4 and 0
    assert pb.value("vllm:kv_cache_usage_perc") == pytest.approx(0.2)  # V1's name for the same figure
    assert pb.value("vllm_multistep:engine_alive") == 2
    first.update_engine_state(KvCacheStats(free_blocks=100, total_blocks=100, running=0, waiting=0))
    first.flush()
    assert pb.value("vllm:num_requests_running") == 0
    assert pb.value("vllm:num_requests_waiting") == 2
    second.on_engine_died()
    assert pb.value("vllm_multistep:engine_alive") == 1
    assert pb.value("vllm:num_requests_waiting") == 0
    first.close()  # an unloaded instance takes its share out
    assert pb.value("vllm_multistep:engine_alive") == 0
    assert pb.value("vllm_multistep:kv_cache_total_blocks") == 100


# --- responder: a request's metrics before its FINAL ------------------------------------------


class FakeSender:
    def __init__(self, log: list) -> None:
        self.log = log

    def send(self, response: Any, flags: int = 0) -> None:
        self.log.append(("send", flags))

    def is_cancelled(self) -> bool:
        return False


class RecordingObserver:
    def __init__(self, log: list) -> None:
        self.log = log

    def on_response(self, *args: Any) -> None:
        self.log.append(("record", args[2]))

    def flush(self) -> None:
        self.log.append(("flush", None))

    def on_step(self, *args: Any) -> None:
        pass


def test_the_responder_flushes_metrics_before_it_sends_a_final() -> None:
    log: list = []
    pb = SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        InferenceResponse=lambda **kwargs: kwargs,
        Tensor=lambda name, array: (name, array),
    )
    responder = Responder(pb, abort=lambda rid: None, observer=RecordingObserver(log))
    request = codec.GenerationRequest(prompt_token_ids=[1, 2], sampling_params=None, stream=True)
    for rid in ("a", "b"):
        responder.register(rid, RequestState(sender=FakeSender(log), request=request, timing=object()))

    def output(rid: str, finished: bool) -> EngineOutput:
        return EngineOutput(rid, [Completion(0, "x", [7])], finished)

    responder._send_outputs(StepOutputs([output("a", False), output("b", False)], 0.01))
    assert log == [("record", False), ("record", False), ("send", 0), ("send", 0)]  # no flush mid-stream
    log.clear()
    responder._send_outputs(StepOutputs([output("a", True), output("b", True)], 0.01))
    assert log == [("record", True), ("record", True), ("flush", None), ("send", 1), ("send", 1)]


@pytest.mark.parametrize("shared", [False, True])
def test_closing_takes_this_instances_share_out_and_frees_its_series_only_when_no_other_stub_holds_them(
    shared: bool,
) -> None:
    """tritonserver 2.51 counts references to a series per stub: deleting one another stub holds frees
    it under that stub (its next update writes into freed memory), so a shared series is never freed."""
    import gc
    import weakref

    pb = FakePbUtils()
    other, closing = new_metrics(pb, instances=2), new_metrics(pb, instances=2)
    for metrics, running in ((other, 3), (closing, 2)):
        metrics.update_engine_state(KvCacheStats(free_blocks=10, total_blocks=16, running=running, waiting=0))
        metrics.flush()
    assert pb.value("vllm:num_requests_running") == 5
    closing.close(shared=shared)
    assert pb.value("vllm:num_requests_running") == 3  # the other instance's share stays
    alive = weakref.ref(closing)
    del closing, metrics
    gc.collect()
    assert (alive() is not None) == shared  # never freed, so its metrics never send a delete


def test_lora_requests_info_has_vllms_labels_one_series_per_adapter_set_valued_with_the_time() -> None:
    """vLLM V0's vllm:lora_requests_info (engine/metrics.py): labels running_lora_adapters,
    waiting_lora_adapters (names once each, comma-joined) and max_lora; value the time the set was last
    current; an earlier set's series stays with its older time (as vLLM leaves it)."""

    pb = FakePbUtils()
    metrics = BackendMetrics(pb, "m", "1", max_model_len=1024, max_loras=2)
    state = KvCacheStats(10, 20, running=3, waiting=1, running_lora_adapters="doll,sheep", waiting_lora_adapters="doll")
    before = time.time()
    metrics.update_engine_state(state)
    metrics.flush()
    first = pb.value(
        "vllm:lora_requests_info", max_lora="2", running_lora_adapters="doll,sheep", waiting_lora_adapters="doll"
    )
    assert before <= first <= time.time()
    metrics.update_engine_state(KvCacheStats(20, 20, running=0, waiting=0))
    metrics.flush()
    later = pb.value("vllm:lora_requests_info", max_lora="2", running_lora_adapters="", waiting_lora_adapters="")
    assert later >= first
    assert (
        pb.value(
            "vllm:lora_requests_info", max_lora="2", running_lora_adapters="doll,sheep", waiting_lora_adapters="doll"
        )
        == first
    )
    without_lora = FakePbUtils()
    plain = new_metrics(without_lora)
    plain.update_engine_state(state)
    plain.flush()
    assert not [key for key in without_lora.series if key[0] == "vllm:lora_requests_info"]


def test_the_router_metrics_have_vllms_names_and_meanings() -> None:
    """What the gateway inference extension's routers and Triton's vLLM backend's PR 92 read: the
    request phases from the engine's own timings of each finished request, tokens per engine step,
    preemptions, and the cache config as labels of a gauge at 1 (two instances: still 1)."""
    pb = FakePbUtils()
    cache_config = (("block_size", "16"), ("num_gpu_blocks", "12"), ("_private", "x"))
    metrics = BackendMetrics(pb, "m", "1", max_model_len=1024, instances=2, cache_config=cache_config)
    BackendMetrics(pb, "m", "1", max_model_len=1024, instances=2, cache_config=cache_config)
    timing = RequestTiming(arrival=100.0, prompt_tokens=6, stream=True)
    times = RequestTimes(100.0, 100.5, 101.25, 104.0, 0)
    metrics.on_response(timing, [(0, 1)], False, now=101.3)
    metrics.on_response(timing, [(0, 3)], True, now=104.1, times=times)
    untimed = RequestTiming(arrival=100.0, prompt_tokens=6, stream=False, n=2)  # V0's n > 1: not timed
    metrics.on_response(untimed, [(0, 2), (1, 2)], True, now=104.1, times=RequestTimes(100.0, None, None, None))
    for tokens, preempted in ((28, 0), (4, 1), (None, 0), (3, 2)):
        metrics.on_step(StepOutputs([], 0.001, iteration_tokens=tokens, preemptions=preempted), 0.0)
    metrics.flush()
    phases = {
        name: pb.observations(f"vllm:request_{name}_time_seconds")
        for name in ("queue", "inference", "prefill", "decode")
    }
    assert phases == {"queue": [0.5], "inference": [3.5], "prefill": [0.75], "decode": [2.75]}
    assert pb.value("vllm:iteration_tokens_total_count") == 3 and pb.value("vllm:iteration_tokens_total_sum") == 35
    assert pb.value("vllm:iteration_tokens_total_bucket", le="1") == 0
    assert pb.value("vllm:iteration_tokens_total_bucket", le="8") == 2
    assert pb.value("vllm:iteration_tokens_total_bucket", le="+Inf") == 3
    assert pb.value("vllm:num_preemptions_total") == 3
    assert pb.value("vllm:cache_config_info", block_size="16", num_gpu_blocks="12") == pytest.approx(1.0)
    assert not [key for key in pb.series if key[0] == "vllm:cache_config_info" and "_private" in dict(key[1])]
