"""Fixtures for every test tier: the environment vLLM runs in and the demo models.

Tiers: unit/ (no vLLM engine, no server), engine/ (real vLLM, no server), e2e/ (real tritonserver).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import scheduling

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The user's thread settings as the session started. vLLM's CPU platform writes OMP_NUM_THREADS
# into os.environ whenever a test builds an engine config in this process; servers started later
# would inherit it as if the user had chosen it (and skip the thread policy).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
_USER_THREADS = {name: os.environ.get(name) for name in _THREAD_VARIABLES}


def _restore_user_threads() -> None:
    for name, value in _USER_THREADS.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module", autouse=True)
def user_thread_settings_per_module() -> None:
    """Before a module's own fixtures (its servers) start: autouse fixtures of a scope run first."""
    _restore_user_threads()


@pytest.fixture(autouse=True)
def user_thread_settings_per_test() -> None:
    _restore_user_threads()


@pytest.fixture(scope="session")
def demo_model_paths() -> dict[str, Path]:
    from triton_vllm_multistep.demo import models as demo_models

    return {name: demo_models.build(name) for name in demo_models.DEMO_MODELS}


# The tiers run fastest first (unit, engine, then e2e): a broken unit shows within a minute, and the
# e2e tier's session servers (GBs of engines) start after the engine tier has finished, instead of
# sitting beside it until the session ends.
_TIER_ORDER = {"unit": 0, "engine": 1, "e2e": 2}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def tier(item: pytest.Item) -> int:
        parts = item.nodeid.split("/")
        return _TIER_ORDER.get(parts[1], len(_TIER_ORDER)) if len(parts) > 2 and parts[0] == "tests" else 0

    items.sort(key=tier)  # stable: each tier keeps pytest's own order


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> scheduling.HeaviestFirstScheduling:
    """With `-n`: whole modules per worker, the SmolLM2 server's users together (tests/scheduling.py)."""
    return scheduling.HeaviestFirstScheduling(config, log)


# Time per tier (setup, call and teardown of its tests: its servers' starts and stops count where
# they happen), printed at the end of every run so that each tier's budget is visible. With xdist
# the tiers' times add up over the workers, so the run's wall time is printed too.
_TIER_SECONDS: dict[str, float] = {}
_MODULE_SECONDS: dict[str, float] = {}
_STARTED = [time.monotonic()]
RECORD_MODULE_SECONDS = "TRITON_VLLM_MULTISTEP_RECORD_MODULE_SECONDS"


def pytest_sessionstart(session: pytest.Session) -> None:
    _STARTED[0] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = report.nodeid.split("/")[1] if report.nodeid.startswith("tests/") else "other"
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
    module = scheduling.module_of(report.nodeid)
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _TIER_SECONDS:
        return
    terminalreporter.section("time per tier")
    measured_before = {"set-up": "TRITON_VLLM_MULTISTEP_SETUP_SECONDS", "lint": "TRITON_VLLM_MULTISTEP_LINT_SECONDS"}
    for part, variable in measured_before.items():
        if variable in os.environ:  # scripts/test.sh measured them before pytest started
            terminalreporter.write_line(f"{part:>8}: {float(os.environ[variable]):7.1f} s")
    for tier, seconds in sorted(_TIER_SECONDS.items()):
        terminalreporter.write_line(f"{tier:>8}: {seconds:7.1f} s")
    terminalreporter.write_line(f"{'tests':>8}: {sum(_TIER_SECONDS.values()):7.1f} s")
    terminalreporter.write_line(f"{'wall':>8}: {time.monotonic() - _STARTED[0]:7.1f} s (from the session's start)")
    if os.environ.get(RECORD_MODULE_SECONDS) and exitstatus == 0:  # weights for tests/scheduling.py
        measured = scheduling.read_module_seconds()  # a partial run (-k, one tier) updates its modules
        measured.update({module: round(seconds, 1) for module, seconds in _MODULE_SECONDS.items()})
        scheduling.MODULE_SECONDS_FILE.write_text(json.dumps(dict(sorted(measured.items())), indent=1) + "\n")
        terminalreporter.write_line(f"module seconds written to {scheduling.MODULE_SECONDS_FILE}")
