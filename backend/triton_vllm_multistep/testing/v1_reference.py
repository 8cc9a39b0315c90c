"""The V1 engine's own answers for the tests: vLLM's offline `LLM` in the V1 environment.

Owns running `LLM.generate` of the V1 environment (.venv-v1) in a subprocess on plain requests
(prompt token ids, SamplingParams fields) and returning each request's token ids: the reference a
`vllm_engine: v1` model must equal, exactly. Knows nothing of servers or of what is asserted.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
fields, requests = json.loads(sys.stdin.read())
llm = LLM(**fields)
params = [SamplingParams(**sampling) for _, _, sampling in requests]
prompts = [{"prompt_token_ids": ids} for _, ids, _ in requests]
outputs = llm.generate(prompts, params, use_tqdm=False)
print("V1-REFERENCE", json.dumps({rid: list(o.outputs[0].token_ids) for (rid, _, _), o in zip(requests, outputs)}))
"""


def offline_v1_tokens(
    python: Path, engine_fields: Mapping[str, Any], requests: Sequence[tuple[str, Sequence[int], Mapping[str, Any]]]
) -> dict[str, list[int]]:
    """Request id → the token ids V1's offline LLM gives (`requests`: id, prompt ids, sampling
    fields; an `output_kind` is dropped: offline answers are whole)."""
    plain = [
        [rid, list(ids), {k: v for k, v in sampling.items() if k != "output_kind"}] for rid, ids, sampling in requests
    ]
    done = subprocess.run(
        [str(python), "-c", _SCRIPT],
        input=json.dumps([dict(engine_fields), plain]),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offline V1 LLM failed:\n{done.stderr[-3000:]}")
    # vLLM logs to stdout too: the answer is the marked line.
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("V1-REFERENCE ")]
    return json.loads(line.removeprefix("V1-REFERENCE "))
