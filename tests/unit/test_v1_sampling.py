"""engine_v1/sampling.py: a request's plain sampling fields (vLLM 0.8.5's names) as vLLM V1's."""

from __future__ import annotations

import pytest

from triton_vllm_multistep.engine_v1.sampling import UnsupportedOnV1, v1_sampling_fields


def test_fields_v1_shares_pass_unchanged_and_guided_decoding_is_structured_outputs() -> None:
    fields = {"temperature": 0.5, "max_tokens": 7, "stop": ["x"], "seed": 3, "output_kind": "DELTA"}
    assert v1_sampling_fields(fields) == fields
    guided = {"choice": ["yes", "no"], "json": None, "backend": None}
    assert v1_sampling_fields({"guided_decoding": guided}) == {"structured_outputs": {"choice": ["yes", "no"]}}
    assert v1_sampling_fields({"logit_bias": {"5": 1.5}}) == {"logit_bias": {5: 1.5}}


@pytest.mark.parametrize(
    ("fields", "kept"),
    [({"best_of": None}, {}), ({"best_of": 2, "n": 2}, {"n": 2}), ({"use_beam_search": False}, {})],
)
def test_removed_fields_at_their_defaults_are_no_request_for_them(fields: dict, kept: dict) -> None:
    assert v1_sampling_fields(fields) == kept


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"best_of": 3, "n": 1}, "best_of=3: vLLM's V1 engine removed best_of"),
        ({"use_beam_search": True}, "use_beam_search=True: vLLM's V1 engine has no beam search"),
    ],
)
def test_fields_v1_removed_are_refused_naming_them(fields: dict, message: str) -> None:
    with pytest.raises(UnsupportedOnV1, match=message):
        v1_sampling_fields(fields)
