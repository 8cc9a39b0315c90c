"""A tokenizer stage's stub runs without torch and without vLLM: in a fresh interpreter, as a stub
imports the stage's model.py (tokenizer_stages.python_model), both stages load their tokenizers and
answer (postprocessing replays vLLM's detokenizer), and neither torch nor any vLLM module is imported.
Through a real server: tests/e2e/test_ensemble.py (the stage stubs map no libtorch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STAGE_RUN = """
import json, sys
sys.path.insert(0, {unit_dir!r})
import numpy as np
import fake_pb_utils as pb
from triton_vllm_multistep.stub import tokenizer_stages

pre = tokenizer_stages.python_model(pb, tokenizer_stages.Preprocessor)()
pre.initialize(pb.initialize_args(pb.model_config(["text_input"], {{"tokenizer_dir": "demo://tiny-llama-spm"}})))
(tokens,) = pre.execute([pb.InferenceRequest({{"text_input": np.array([[b"say hello world"]], dtype=np.object_)}})])
ids = tokens.arrays()["input_ids"].reshape(-1).tolist()
post = tokenizer_stages.python_model(pb, tokenizer_stages.Postprocessor)()
post.initialize(pb.initialize_args(pb.model_config(["window_ids", "window_offsets"], {{"tokenizer_dir": "demo://tiny-llama-spm"}})))
window = {{"window_ids": np.array([ids], np.int32), "window_offsets": np.array([[1, 0, 3]], np.int32)}}
(text,) = post.execute([pb.InferenceRequest(window)])
print(json.dumps({{
    "ids": ids,
    "text": text.arrays()["text_output"].reshape(-1)[0].decode(),
    "torch": "torch" in sys.modules,
    "vllm": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
    "transformers": "transformers" in sys.modules,
}}))
"""


def test_a_tokenizer_stage_imports_neither_torch_nor_vllm() -> None:
    code = STAGE_RUN.format(unit_dir=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(seen["ids"]) > 2 and seen["text"]  # both stages worked
    assert seen["transformers"] and not seen["torch"] and seen["vllm"] == []
    assert "None of PyTorch" not in run.stderr  # transformers' notice is not a user's concern here
