"""Test-only fault injection: makes the engine's forward pass raise, as a failing engine would.

Owns the switch (an environment variable naming a file) and the hook; armed only from the
server's environment, never from a request.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Once the file this names exists, the model's next forward pass raises.
FAULT_FILE_ENV = "TRITON_VLLM_MULTISTEP_TEST_ENGINE_FAULT_FILE"


class InjectedEngineFault(RuntimeError):
    """Raised inside the engine's forward pass by the test-only fault injection."""


def install_fault_injection(model: Any) -> None:
    """Arm the fault on `model` (the driver's torch module, or None) when the environment asks."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or model is None:
        return
    logger.warning("test-only engine fault injection is armed: %s=%s", FAULT_FILE_ENV, path)

    def maybe_fail(*_: object) -> None:
        if os.path.exists(path):
            raise InjectedEngineFault(f"injected engine fault ({FAULT_FILE_ENV})")

    model.register_forward_pre_hook(maybe_fail)
