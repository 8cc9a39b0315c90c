"""What `auto_complete_config` fills in of a model's config: the decoupled policy, no batching, and
every input and output the interface documents (docs/interface.md), keeping what config.pbtxt says.
"""

from __future__ import annotations

from typing import Any

from triton_vllm_multistep.stub import codec, instance, triton_io


class AutoCompleteConfig:
    """The part of pb_utils.ModelConfig that auto_complete_config uses."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def as_dict(self) -> dict[str, Any]:
        return self.config

    def add_input(self, spec: dict[str, Any]) -> None:
        self.config.setdefault("input", []).append(spec)

    def add_output(self, spec: dict[str, Any]) -> None:
        self.config.setdefault("output", []).append(spec)

    def set_max_batch_size(self, size: int) -> None:
        self.config["max_batch_size"] = size

    def set_model_transaction_policy(self, policy: dict[str, bool]) -> None:
        self.config["model_transaction_policy"] = policy


def test_auto_complete_adds_what_is_missing_and_keeps_what_is_there() -> None:
    own_text_input = {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": False}
    completed = instance.auto_complete(AutoCompleteConfig({"input": [own_text_input]})).as_dict()
    inputs = {spec["name"]: spec for spec in completed["input"]}
    outputs = {spec["name"]: spec for spec in completed["output"]}
    assert inputs["text_input"] is own_text_input  # not replaced
    assert [spec["name"] for spec in completed["input"]].count("text_input") == 1
    request_inputs = {"text_input", "input_ids", "image", "stream", "sampling_parameters", "exclude_input_in_output"}
    assert set(inputs) == request_inputs | {"priority", "embedding_request"} | set(codec.RETURN_FLAGS)
    assert all(spec["optional"] for name, spec in inputs.items() if name != "text_input")
    assert inputs["input_ids"]["data_type"] == "TYPE_INT32" and inputs["stream"]["data_type"] == "TYPE_BOOL"
    assert set(outputs) == {
        "text_output",
        "output_ids",
        "finish_reason",
        "cumulative_logprob",
        "logprobs",
        "num_input_tokens",
        "num_output_tokens",
        "window_ids",
        "window_offsets",
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
        "num_cached_tokens",
        "prompt_logprobs",
    }
    assert outputs["window_offsets"]["dims"] == [3]
    assert outputs["first_token_time_ns"]["data_type"] == "TYPE_INT64"
    assert outputs["num_cached_tokens"]["data_type"] == "TYPE_UINT32"
    assert completed["max_batch_size"] == 0
    assert completed["model_transaction_policy"] == {"decoupled": True}


class _Requested:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def requested_output_names(self) -> list[str]:
        return self.names


def test_requested_outputs_are_none_when_every_output_is_asked_for() -> None:
    # Triton asks for every declared output when the client names none.
    assert triton_io.requested_outputs(_Requested(list(instance.OUTPUT_NAMES)), instance.OUTPUT_NAMES) is None
    asked = triton_io.requested_outputs(_Requested(["window_ids", "window_offsets"]), instance.OUTPUT_NAMES)
    assert asked == frozenset({"window_ids", "window_offsets"})


def test_a_stub_without_requested_output_names_builds_every_output() -> None:
    assert triton_io.requested_outputs(object(), instance.OUTPUT_NAMES) is None
