"""A request batch the stub decodes is freed when execute() returns, also the first batch of a stub.

vLLM 0.8.5 keeps the traceback of its failed `import ray`, and with it the stack that first imported
vLLM: a stub that first imports it inside execute() keeps that batch's Triton request objects until
its exit, where their destructors abort the stub or keep it from exiting (stub/codec.py,
`import_sampling_checks`; seen as a V1 model's unload that never completed). Each case runs in a
fresh interpreter, as a stub starts: with the import made at load, and without it (the mechanism the
load-time import defends against, so that this test can fail).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

BATCH = """
import gc, weakref
import numpy as np
from triton_vllm_multistep.stub import codec
if {import_at_load}:
    codec.import_sampling_checks()  # what the stub does while it loads the model

class Request:  # stands in for pb_utils.InferenceRequest
    pass

def execute(requests):
    for request in requests:
        codec.decode_request(
            {{"input_ids": np.array([1, 2], dtype=np.int32),
             "sampling_parameters": np.array([b'{{"temperature": 0, "max_tokens": 4}}'], dtype=object)}},
            None, codec.ModelLimits(vocab_size=100, max_model_len=64), encode=None, decode=None,
        )

def first_batch():
    requests = [Request()]
    execute(requests)
    return weakref.ref(requests[0])

request = first_batch()
gc.collect()
print("alive" if request() is not None else "freed")
"""


@pytest.mark.parametrize(("import_at_load", "expected"), [(True, "freed"), (False, "alive")])
def test_the_first_batch_is_freed_once_vllm_is_imported_at_load(import_at_load: bool, expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", BATCH.format(import_at_load=import_at_load)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected, done.stdout
