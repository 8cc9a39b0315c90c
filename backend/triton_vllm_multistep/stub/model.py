"""Triton entry points of the `vllm_multistep` backend; all the work is in triton_vllm_multistep.

Installed as `<backends>/vllm_multistep/model.py` (by the launcher, or `triton-vllm-multistep
install-backend`), so model folders need no model.py. Runs only inside the Triton stub.
"""

import triton_python_backend_utils as pb_utils

from triton_vllm_multistep.stub import instance


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return instance.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self._server = instance.ModelServer(pb_utils, args)

    def execute(self, requests):
        self._server.execute(requests)
        return None

    def finalize(self):
        self._server.close()
