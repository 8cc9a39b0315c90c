"""The V1 engine's own answers for the tests and the GPU smoke check: vLLM's offline `LLM` in the V1 environment.

Owns running `LLM.generate` of the V1 environment (.venv-v1) in a subprocess on plain requests
(prompt token ids or text; V1's SamplingParams fields, `structured_outputs` as a dict) and
returning each request's token ids and text: the reference a `vllm_engine: v1` model must equal,
exactly. Knows nothing of servers or of what is asserted.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
fields, requests, separately = json.loads(sys.stdin.read())
llm = LLM(**fields)
def params_of(sampling):
    if "structured_outputs" in sampling:
        sampling = {**sampling, "structured_outputs": StructuredOutputsParams(**sampling["structured_outputs"])}
    return SamplingParams(**sampling)
params = [params_of(sampling) for _, _, sampling, _, _ in requests]
prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for _, p, _, _, _ in requests]
for prompt, (*_, images) in zip(prompts, requests):
    if images:  # image files, base64: decoded as the engine process decodes the stub's
        import base64, io
        from PIL import Image
        files = [io.BytesIO(base64.b64decode(data)) for data in images]
        prompt["multi_modal_data"] = {"image": [Image.open(file).convert("RGB") for file in files]}
adapters = None
if any(adapter for *_, adapter, _ in requests):
    from vllm.lora.request import LoRARequest
    adapters = [adapter and LoRARequest(*adapter) for *_, adapter, _ in requests]
if separately:  # each request in a batch of its own
    outputs = [llm.generate([p], [q], use_tqdm=False, lora_request=adapters and [adapters[i]])[0]
               for i, (p, q) in enumerate(zip(prompts, params))]
else:
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
found = {r[0]: [list(o.outputs[0].token_ids), o.outputs[0].text] for r, o in zip(requests, outputs)}
print("V1-REFERENCE", json.dumps(found))
"""


def offline_v1_tokens(
    python: Path, engine_fields: Mapping[str, Any], requests: Sequence[tuple[str, Sequence[int], Mapping[str, Any]]]
) -> dict[str, list[int]]:
    """Request id → the token ids V1's offline LLM gives (`requests`: id, prompt ids, sampling
    fields; an `output_kind` is dropped: offline answers are whole)."""
    return {rid: ids for rid, (ids, _) in offline_v1_outputs(python, engine_fields, requests).items()}


def offline_v1_outputs(
    python: Path,
    engine_fields: Mapping[str, Any],
    requests: Sequence[tuple[str, Sequence[int] | str, Mapping[str, Any]] | tuple[str, Any, Any, Any]],
    separately: bool = False,
    images: Mapping[str, Sequence[bytes]] | None = None,
) -> dict[str, tuple[list[int], str]]:
    """Request id → (token ids, text) V1's offline LLM gives; a prompt is token ids or text (which
    V1 tokenizes as it does any text prompt); a fourth item is a LoRA adapter as (name, id, path);
    `images`: request id → the image files its prompt's placeholders stand for (what an EngineRequest carries).
    `separately`: each request in a batch of its own (vLLM 0.32's CPU LoRA gives a base request
    batched with adapter requests an adapter's delta: engine_v1/cpu_lora.py)."""
    plain = [
        [
            rid,
            prompt if isinstance(prompt, str) else list(prompt),
            {k: v for k, v in sampling.items() if k != "output_kind"},
            list(adapter[0]) if adapter and adapter[0] else None,
            [base64.b64encode(data).decode() for data in (images or {}).get(rid, ())],
        ]
        for rid, prompt, sampling, *adapter in requests
    ]
    stdout = run_v1_script(python, _SCRIPT, (), json.dumps([dict(engine_fields), plain, separately]), "offline V1 LLM")
    # vLLM logs to stdout too: the answer is the marked line.
    (line,) = [line for line in stdout.splitlines() if line.startswith("V1-REFERENCE ")]
    return {rid: (ids, text) for rid, (ids, text) in json.loads(line.removeprefix("V1-REFERENCE ")).items()}


def run_v1_script(
    python: Path | str,
    script: str,
    arguments: Sequence[str],
    stdin: str | None,
    what: str,
    environment: Mapping[str, str] | None = None,
) -> str:
    """`python -c script arguments` under the V1 environment's Python (`environment` over this
    process's); its stdout, or RuntimeError naming `what` with its stderr's end."""
    done = subprocess.run(
        [str(python), "-c", script, *arguments],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, **(environment or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return done.stdout
