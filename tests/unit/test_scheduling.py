"""How the suite is spread over xdist's workers (tests/scheduling.py): units and their order."""

from __future__ import annotations

import json
from pathlib import Path

import scheduling


def test_a_module_is_one_unit_and_a_session_servers_users_are_one_unit_together() -> None:
    assert scheduling.unit_of("tests/e2e/test_fuzz.py::test_a[1]") == "tests/e2e/test_fuzz.py"
    assert scheduling.unit_of("tests/e2e/test_fuzz.py::Case::test_b") == "tests/e2e/test_fuzz.py"
    seen: list[str] = []
    for unit, (_, modules) in scheduling.SESSION_SERVER_UNITS.items():
        assert {scheduling.unit_of(f"{module}::test_x") for module in modules} == {unit}
        assert scheduling.modules_of(unit) == modules
        for module in modules:
            assert (Path(__file__).parents[2] / module).is_file(), module
        seen += modules
    assert len(seen) == len(set(seen))  # a module in one unit only


def test_units_run_unit_tier_first_then_heaviest_first_with_unmeasured_ones_at_the_median() -> None:
    seconds = {
        "tests/unit/test_a.py": 1.0,
        "tests/engine/test_b.py": 50.0,
        "tests/e2e/test_c.py": 300.0,
        "tests/e2e/test_real_model.py": 60.0,
        "tests/e2e/test_openai_served.py": 60.0,
    }
    units = ["tests/unit/test_z.py", "tests/e2e/test_new.py", "tests/engine/test_b.py",
             "smollm2-server", "tests/unit/test_a.py", "tests/e2e/test_c.py"]  # fmt: skip
    order = scheduling.unit_order(units, seconds)
    # The SmolLM2 unit weighs its four modules: 60 + 60 + the median (60) twice = 240.
    assert order == ["tests/unit/test_z.py", "tests/unit/test_a.py", "tests/e2e/test_c.py",
                     "smollm2-server", "tests/e2e/test_new.py", "tests/engine/test_b.py"]  # fmt: skip
    assert scheduling.unit_order(["b", "a"], {}) == ["b", "a"]  # nothing measured: the order given


def test_module_seconds_are_read_from_their_file_or_empty(tmp_path: Path) -> None:
    assert scheduling.read_module_seconds(tmp_path / "missing.json") == {}
    path = tmp_path / "seconds.json"
    path.write_text(json.dumps({"tests/e2e/test_c.py": 12.5}))
    assert scheduling.read_module_seconds(path) == {"tests/e2e/test_c.py": 12.5}
