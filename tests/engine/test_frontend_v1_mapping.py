"""frontend_v1/triton_requests.py: vLLM 0.32's SamplingParams → a V1 model's request, and its
responses → vLLM 0.32's RequestOutputs, run where that code runs (`.venv-v1`'s Python, a subprocess).

Every field vLLM 0.32's serving code may set is sent by vLLM's name or refused by name (never
dropped); streaming follows the output kind; responses split per completion with their logprobs.
The served checks (vllm serve's tokens through the API) are tests/e2e/test_v1_served.py's.
"""

from __future__ import annotations

import json

from triton_vllm_multistep.checks.v1_reference import run_v1_script
from triton_vllm_multistep.settings.v1_environment import PACKAGE_PARENT, v1_environment_python

SCRIPT = r"""
import json
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from triton_vllm_multistep.frontend_v1 import triton_requests as m

found = {}
params = SamplingParams(n=2, max_tokens=7, temperature=0.5, top_k=4, seed=3, stop=["x"], logprobs=2,
                        logit_bias={5: -1.0}, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA,
                        structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
request = m.triton_request([1, 2, 3], params, "doll", priority=-2)
found["sampling"] = json.loads(request.inputs["sampling_parameters"][0])
found["stream"] = bool(request.inputs["stream"][0])
found["outputs"] = list(request.outputs)
found["priority"] = int(request.inputs["priority"][0])
whole = m.triton_request([1], SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY), None)
found["whole_stream"] = bool(whole.inputs["stream"][0])
found["defaults"] = json.loads(whole.inputs["sampling_parameters"][0])
try:
    m.sampling_parameters(SamplingParams(max_tokens=2, thinking_token_budget=5))
except m.UnsupportedRequest as error:
    found["refused"] = str(error)
step = json.dumps([{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}, {"8": {"logprob": -0.25, "rank": 1}}])
values = {"text_output": [b"a", b"bc"], "output_ids": [7, 8, 9], "finish_reason": [b"None", b"length"],
          "num_output_tokens": [1, 2], "logprobs": [step.encode(), step.encode()],
          "prompt_logprobs": [json.dumps([None, {"2": {"logprob": -1.5, "rank": 3}}]).encode()]}
output = m.request_output("r", [1, 2], values, 2)
found["completions"] = [(c.index, list(c.token_ids), c.text, c.finish_reason) for c in output.outputs]
found["logprob"] = [output.outputs[0].logprobs[0][7].logprob, output.outputs[0].logprobs[0][7].decoded_token]
found["prompt_logprobs"] = [output.prompt_logprobs[0], output.prompt_logprobs[1][2].rank]
found["finished"] = output.finished
# Streamed n > 1: the parts V1's own engine would stream (new tokens, or a finish once).
finish_sent = set()
parts = [m.new_parts(output.outputs, finish_sent)]
values.update(output_ids=[10], text_output=[b"d", b""], num_output_tokens=[1, 0], finish_reason=[b"None", b"length"])
parts.append(m.new_parts(m.request_output("r", [1, 2], values, 2).outputs, finish_sent))
values.update(output_ids=[], text_output=[b"", b""], num_output_tokens=[0, 0], finish_reason=[b"stop", b"length"])
parts.append(m.new_parts(m.request_output("r", [1, 2], values, 2).outputs, finish_sent))
found["streamed_parts"] = [[(c.index, list(c.token_ids), c.finish_reason) for c in step] for step in parts]
print(json.dumps(found))
"""


def test_vllm_032s_sampling_params_become_a_v1_models_request_and_its_responses_vllms_outputs() -> None:
    python = v1_environment_python()
    assert python is not None, "scripts/setup.sh builds .venv-v1"
    found = json.loads(
        run_v1_script(python, SCRIPT, [], None, "the V1 mapping script", {"PYTHONPATH": PACKAGE_PARENT}).splitlines()[
            -1
        ]
    )
    assert found["sampling"] == {
        "n": 2,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_k": 4,
        "seed": 3,
        "stop": ["x"],
        "logprobs": 2,
        "prompt_logprobs": 1,
        "logit_bias": {"5": -1.0},
        "structured_outputs": {"choice": ["a", "b"]},
        "lora_name": "doll",
    }
    assert found["stream"] and not found["whole_stream"] and found["priority"] == -2
    assert found["outputs"] == [
        "text_output",
        "output_ids",
        "finish_reason",
        "num_output_tokens",
        "logprobs",
        "prompt_logprobs",
    ]
    assert found["defaults"] == {"n": 1, "max_tokens": 2}  # nothing at its default is sent
    assert found["refused"].startswith("thinking_token_budget is not served through this API")
    assert found["completions"] == [[0, [7], "a", None], [1, [8, 9], "bc", "length"]]
    assert found["logprob"] == [-0.5, "a"] and found["prompt_logprobs"] == [None, 3]
    assert found["finished"] is False
    # One with a token, one finishing; then the finished one's empty delta is left out; then the
    # first's finish without tokens (once), the second's already sent.
    assert found["streamed_parts"] == [
        [[0, [7], None], [1, [8, 9], "length"]],
        [[0, [10], None]],
        [[0, [], "stop"]],
    ]
