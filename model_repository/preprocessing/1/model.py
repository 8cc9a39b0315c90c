"""Ensemble preprocessing: the logic is triton_vllm_multistep.tokenizer_models.Preprocessor."""

import triton_python_backend_utils as pb_utils

from triton_vllm_multistep import tokenizer_models

TritonPythonModel = tokenizer_models.python_model(pb_utils, tokenizer_models.Preprocessor)
