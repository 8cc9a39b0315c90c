"""The model instance's heartbeat: a gauge on Triton's metrics endpoint that the response thread
sets to the time every HEARTBEAT_SECONDS, for health checks that a wedge cannot fake.

Owns the gauge and when to set it; must not decide health (host/probe.py reads the gauge's age).
Why a gauge set over pb_utils: each set is a round trip from the response thread (the one thread
that calls into Triton) through tritonserver's Python backend to its metrics registry, so the
value stops moving when that thread, the stub or the backend's side in tritonserver is stuck, while
Triton's own endpoints (/v2/health/live, model readiness) still answer 200.
"""

from __future__ import annotations

import time
from typing import Any

from triton_vllm_multistep.lifecycle.protocol import HEARTBEAT_METRIC, HEARTBEAT_SECONDS, HEARTBEAT_STALE_SECONDS
from triton_vllm_multistep.stub.triton_io import TritonCaller


class Heartbeat:
    """One series per model instance (labels model, version, instance)."""

    def __init__(self, pb_utils: Any, model: str, version: str, instance: str, caller: TritonCaller) -> None:
        self._caller = caller
        self._family = pb_utils.MetricFamily(
            name=HEARTBEAT_METRIC,
            description=(
                "Unix time at which this model instance's response thread last reached Triton "
                f"(set every {HEARTBEAT_SECONDS:.0f} s; older than {HEARTBEAT_STALE_SECONDS:.0f} s: stuck)"
            ),
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self._gauge = self._family.Metric(labels={"model": model, "version": version, "instance": instance})
        self._beaten_at = float("-inf")
        self.beat()

    def beat(self, now: float | None = None) -> None:
        """Set the gauge to the time if a beat is due (cheap to call often: a clock read)."""
        now = time.monotonic() if now is None else now
        if now - self._beaten_at < HEARTBEAT_SECONDS:
            return
        self._caller.check("setting the heartbeat")
        self._beaten_at = now
        self._gauge.set(time.time())

    def close(self) -> None:
        """Delete the series (metric first, then its family, as pb_utils requires)."""
        self._caller.check("deleting the heartbeat")
        self._gauge = None
        self._family = None
