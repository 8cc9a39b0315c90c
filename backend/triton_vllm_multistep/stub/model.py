"""Triton entry points of the `vllm_multistep` backend; all the work is in triton_vllm_multistep.

Installed as `<backends>/vllm_multistep/model.py` (by the launcher, or `triton-vllm-multistep
install-backend`), so model folders need no model.py. Runs only inside the Triton stub.
"""

import triton_python_backend_utils as pb_utils

from triton_vllm_multistep.stub import instance, stall_guard

# At import, before anything else runs in this stub: Triton's auto-complete stub is guarded too.
stall_guard.guard_this_stub()


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return instance.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self._guard = stall_guard.start_for(args)
        try:
            self._server = instance.ModelServer(pb_utils, args)
        except BaseException as error:
            self._guard.finalizing()  # a failed load ends the stub: an expected exit
            if not isinstance(error, instance.SETTINGS_ERRORS):
                raise
            # A settings problem, not a bug: its message says what to do. Raised afresh here so
            # that Triton's load error lists this frame only, not the frames that found it.
            raise type(error)(str(error)) from None

    def execute(self, requests):
        self._server.execute(requests)
        return None

    def finalize(self):
        self._guard.finalizing()
        self._server.close()
