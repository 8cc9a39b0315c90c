"""The test-only fault hooks (testing/faults.py) arm the engine loop at its own import, so that a
stub refusing its settings never imports vLLM for their sake; the engine-failure end-to-end tests
show the armed faults act."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from triton_vllm_multistep.testing import faults


def test_a_module_imported_later_is_patched_right_after_its_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "later_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    faults._when_imported("later_module", lambda module: seen.append(module.VALUE))
    assert seen == []
    import later_module  # noqa: F401  (the import under test)

    assert seen == [1]
    assert not any(isinstance(finder, faults._PatchAtImport) for finder in sys.meta_path)
    faults._when_imported("later_module", lambda module: seen.append(module.VALUE + 1))
    assert seen == [1, 2]  # already imported: patched at once
    sys.modules.pop("later_module")


def test_installing_the_hooks_imports_neither_the_engine_loop_nor_vllm(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from triton_vllm_multistep.engine import extensions\n"
        "assert extensions.install_from_environment() == ['triton_vllm_multistep.testing.faults']\n"
        "print(sorted(m for m in ('vllm', 'torch', 'triton_vllm_multistep.engine.loop') if m in sys.modules))\n"
    )
    env = {**faults.server_environment(tmp_path / "fault"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
