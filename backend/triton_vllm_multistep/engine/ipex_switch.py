"""Turning Intel Extension for PyTorch off for one process, before vLLM is imported there.

Owns the `use_ipex: false` mechanism: the package is made unimportable in this process (both
vLLM's import tests and its `find_spec` check then see a host without it), which is why it must
run before anything imports vLLM or torch extensions. Imports nothing heavy itself; must not
decide when to use it (the stub reads the setting).
"""

from __future__ import annotations

import sys

IPEX_MODULE = "intel_extension_for_pytorch"


class IpexAlreadyLoadedError(RuntimeError):
    """IPEX was imported before it could be turned off."""


def turn_ipex_off() -> None:
    """Make IPEX unimportable in this process, as on a host without the package."""
    if sys.modules.get(IPEX_MODULE) is not None:
        raise IpexAlreadyLoadedError(
            "use_ipex=false cannot take effect: intel_extension_for_pytorch was already imported in this process"
        )
    sys.modules[IPEX_MODULE] = None  # type: ignore[assignment]  # import raises, find_spec answers None


def ipex_turned_off() -> bool:
    """Whether turn_ipex_off() ran in this process."""
    return IPEX_MODULE in sys.modules and sys.modules[IPEX_MODULE] is None
