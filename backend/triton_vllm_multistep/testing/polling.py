"""Waiting for a condition in tests: poll until it holds or a timeout passes.

Owns the one polling loop the test tiers share; the timeout is a bound on waiting, never a
speed assertion (tests assert the condition, not how fast it came).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    """Poll `condition` until it holds (True) or `timeout` s pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
