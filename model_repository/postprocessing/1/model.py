"""Ensemble postprocessing: the logic is triton_vllm_multistep.stub.tokenizer_stages.Postprocessor."""

import triton_python_backend_utils as pb_utils

from triton_vllm_multistep.stub import tokenizer_stages

TritonPythonModel = tokenizer_stages.python_model(pb_utils, tokenizer_stages.Postprocessor)
