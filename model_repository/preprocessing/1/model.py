"""Ensemble preprocessing: the logic is triton_vllm_multistep.tokenizer_models.Preprocessor."""

import json

import triton_python_backend_utils as pb_utils

from triton_vllm_multistep import tokenizer_models


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self._names = [item["name"] for item in config["input"]]
        tokenizer_dir = tokenizer_models.parameter(config, "tokenizer_dir", "demo://tiny-llama-bpe")
        self._handler = tokenizer_models.Preprocessor(tokenizer_models.load_tokenizer(tokenizer_dir))

    def execute(self, requests):
        return tokenizer_models.run_batch(pb_utils, requests, self._names, self._handler)
