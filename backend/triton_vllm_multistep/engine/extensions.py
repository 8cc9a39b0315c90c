"""Extension modules named by the environment (TRITON_VLLM_MULTISTEP_HOOKS): how tests inject
faults from outside, so that no product module imports test code.

Owns importing each named module once per process and calling its `install()`; must not know what
a module does. The stub calls it for itself and the engine it may run; the engine process calls it
once vLLM is imported (it inherits the stub's environment).
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger(__name__)

HOOKS_ENV = "TRITON_VLLM_MULTISTEP_HOOKS"
# The Triton model a stub serves, set by the stub for itself and the engine process it starts.
MODEL_NAME_ENV = "TRITON_VLLM_MULTISTEP_MODEL_NAME"
_installed: set[str] = set()


def install_from_environment() -> list[str]:
    """Import the comma-separated modules HOOKS_ENV names (once each) and call their `install()`;
    returns the names installed now. A module that fails to import or install raises: a test that
    asked for a fault must not run without it."""
    names = [name.strip() for name in os.environ.get(HOOKS_ENV, "").split(",") if name.strip()]
    installed = []
    for name in names:
        if name in _installed:
            continue
        logger.warning("installing extension module %s (%s)", name, HOOKS_ENV)
        importlib.import_module(name).install()
        _installed.add(name)
        installed.append(name)
    return installed
