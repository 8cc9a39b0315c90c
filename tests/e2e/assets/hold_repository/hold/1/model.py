"""Answers each request once, then holds its response sender forever (never FINAL)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.held = []

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            data = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", data)]))
            self.held.append(sender)
        return None
