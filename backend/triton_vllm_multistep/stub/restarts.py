"""How many times `serve --restart-on-crash` started the server again before this one, as a counter on
Triton's metrics endpoint (vllm_multistep:server_restarts_total), one series per model instance.

Owns the counter; must not decide anything about restarts (the launcher does, host/launcher.py).
One series per instance (labels model, version, instance): never shared between stubs, whose
shared series Triton 2.51 frees twice (docs/lifecycle.md).
"""

from __future__ import annotations

import os
from typing import Any

from triton_vllm_multistep.stub.triton_io import TritonCaller
from triton_vllm_multistep.stubguard.records import RESTARTS_METRIC, SERVER_RESTARTS_ENV


def restarts_so_far() -> int:
    try:
        return max(0, int(os.environ.get(SERVER_RESTARTS_ENV, "0")))
    except ValueError:
        return 0


class RestartCount:
    def __init__(self, pb_utils: Any, model: str, version: str, instance: str, caller: TritonCaller) -> None:
        self._caller = caller
        self._family = pb_utils.MetricFamily(
            name=RESTARTS_METRIC,
            description="Times `triton-vllm-multistep serve --restart-on-crash` started tritonserver again after it "
            "died without being asked to stop, before the server publishing this",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self._counter = self._family.Metric(labels={"model": model, "version": version, "instance": instance})
        restarts = restarts_so_far()
        if restarts:
            self._counter.increment(restarts)

    def close(self) -> None:
        self._caller.check("deleting the restart counter")
        self._counter = None
        self._family = None
