"""How the suite spreads over pytest-xdist's workers (scripts/test.sh runs `-n 2`).

Why two workers on a two-core host: a served test mostly waits (for a server start, for an engine
that computes on one core), and an engine test spends most of its time in single-threaded Python;
two workers keep both cores busy. What a worker gets is a work unit, never split: one test module
(its module-scoped servers start once), or all the modules that use one of the e2e tier's session
servers (`SESSION_SERVER_UNITS`), so that each of those servers starts once per run, not once per
worker (a start of the tiny server costs about a minute of CPU: eight stubs, four engines).

Order: the unit tier first (a broken unit shows within a minute), then the heaviest units first
(longest-processing-time first: the last unit to start is a short one, so the workers finish
together). Each unit's weight is its measured seconds from `module_seconds.json` (written by a run
with TRITON_VLLM_MULTISTEP_RECORD_MODULE_SECONDS=1); a module not measured yet weighs the median.
Weights only order the work; they decide nothing a test asserts.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

MODULE_SECONDS_FILE = Path(__file__).with_name("module_seconds.json")

# Work unit → (the session fixture its modules share, the modules). tests/e2e/conftest.py checks at
# collection that every user of each fixture is listed here, and that no module uses two of them.
SESSION_SERVER_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "smollm2-server": (
        "smollm2_lora_server",
        (
            "tests/e2e/test_real_model.py",
            "tests/e2e/test_lora_real_model.py",
            "tests/e2e/test_openai_served.py",
            "tests/e2e/test_embeddings_served.py",
        ),
    ),
    "tiny-server": (
        "server",
        (
            "tests/e2e/test_llm_e2e.py",
            "tests/e2e/test_sampling_exactness.py",
            "tests/e2e/test_ensemble.py",
            "tests/e2e/test_engine_process_served.py",
            "tests/e2e/test_metrics.py",
            "tests/e2e/test_soak.py",
            # Modules whose own models the session server loads for them (private_servers.loaded_into).
            "tests/e2e/test_stream_modes.py",
            "tests/e2e/test_prefix_caching_served.py",
            "tests/e2e/test_lora_served.py",
        ),
    ),
}
_UNIT_OF_MODULE = {module: unit for unit, (_, modules) in SESSION_SERVER_UNITS.items() for module in modules}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The work unit a test belongs to: its module, or the unit of the session server it uses."""
    module = module_of(nodeid)
    return _UNIT_OF_MODULE.get(module, module)


def modules_of(unit: str) -> tuple[str, ...]:
    return SESSION_SERVER_UNITS[unit][1] if unit in SESSION_SERVER_UNITS else (unit,)


def read_module_seconds(path: Path = MODULE_SECONDS_FILE) -> dict[str, float]:
    return json.loads(path.read_text()) if path.is_file() else {}


def unit_order(units: Iterable[str], module_seconds: Mapping[str, float]) -> list[str]:
    """Unit-tier modules first (in the order given), then the rest heaviest first."""
    units = list(units)
    typical = statistics.median(module_seconds.values()) if module_seconds else 1.0

    def weight(unit: str) -> float:
        return sum(module_seconds.get(module, typical) for module in modules_of(unit))

    first = [unit for unit in units if unit.startswith("tests/unit/")]
    rest = sorted((unit for unit in units if unit not in first), key=weight, reverse=True)  # stable
    return first + rest


class HeaviestFirstScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (a unit goes whole to one worker, which asks for the next when it
    is nearly done) with this module's units and order."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed:
            self._order_workqueue_once()
        super().schedule()

    def _order_workqueue_once(self) -> None:
        # LoadScopeScheduling.schedule fills its queue only when it is empty, ordered by test count;
        # filling it here (the same structure, in this order) is what it then hands out.
        if not self._check_nodes_have_same_collection():
            return  # the queue stays empty, as upstream leaves it: super().schedule() reports and aborts
        collection = next(iter(self.registered_collections.values()))
        units: dict[str, dict[str, bool]] = {}
        for nodeid in collection:
            units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
        for unit in unit_order(units, read_module_seconds()):
            self.workqueue[unit] = units[unit]
