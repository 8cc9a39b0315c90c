"""What a Kubernetes pod running this backend must allow for: the termination grace period.

Owns the arithmetic from the drain protocol's timings (lifecycle/protocol.py) to the pod's
terminationGracePeriodSeconds; must not read manifests or talk to a cluster. Checked against
deploy/kubernetes by tests/unit/test_kubernetes_manifests.py; explained in docs/scaling-out.md.
"""

from __future__ import annotations

import math

from triton_vllm_multistep.lifecycle.protocol import EXIT_GRACE_SECONDS, SETTLE_SECONDS


def minimum_grace_period(exit_timeout: float, drain_timeout: float | None = None) -> int:
    """Seconds from the start of the preStop hook that the pod needs before the kubelet's SIGKILL.

    The kubelet counts terminationGracePeriodSeconds from the start of preStop, through SIGTERM:
    - preStop `triton-vllm-multistep drain`: waits up to `drain_timeout` (default: the server's
      --exit-timeout-secs) for every instance to drain, then SETTLE_SECONDS for ensembles;
    - SIGTERM to tritonserver: Triton unloads its models within --exit-timeout-secs;
    - EXIT_GRACE_SECONDS: Triton 2.51 can hang in its exit path once the exit timeout expired with
      a Python backend busy (the launcher allows the same before killing it).
    """
    drain = exit_timeout if drain_timeout is None else drain_timeout
    return math.ceil(drain + SETTLE_SECONDS + exit_timeout + EXIT_GRACE_SECONDS)
