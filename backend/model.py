"""Triton entry points of the `vllm_multistep` backend; all the work is in triton_vllm_multistep.

Installed as `<backends>/vllm_multistep/model.py`, so model folders need no model.py.
"""

import triton_python_backend_utils as pb_utils

from triton_vllm_multistep import serving


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return serving.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self._server = serving.ModelServer(pb_utils, args)

    def execute(self, requests):
        self._server.execute(requests)
        return None

    def finalize(self):
        self._server.close()
