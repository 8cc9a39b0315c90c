"""Which Python runs the engine process (engine/process.py): the stub's sys.executable is not one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from triton_vllm_multistep.engine.process import (
    PYTHON_ENV,
    EngineProcess,
    EngineProcessError,
    EngineSpec,
    NoPythonForEngineProcess,
    python_for_children,
)
from triton_vllm_multistep.settings.v1_environment import V1_PYTHON_ENV, v1_import_path


def test_the_environment_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PYTHON_ENV, "/opt/py/bin/python3")
    assert python_for_children() == "/opt/py/bin/python3"


def test_else_this_interpreter_when_it_is_a_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", "/venv/bin/python3.11")
    assert python_for_children() == "/venv/bin/python3.11"


def test_inside_the_triton_stub_the_python_of_this_version_first_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/tritonserver/backends/python/triton_python_backend_stub")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    fake = tmp_path / version
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert python_for_children() == str(fake)


def test_inside_the_stub_without_a_python_of_this_version_there_is_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/tritonserver/backends/python/triton_python_backend_stub")
    (tmp_path / "python3").write_text("#!/bin/sh\n")  # another version would not load this environment
    (tmp_path / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert python_for_children() is None
    with pytest.raises(NoPythonForEngineProcess, match=f"no python.* on PATH and {PYTHON_ENV} is not set"):
        EngineProcess(EngineSpec({"model": "m"}, "step")).start_engine()


def test_a_python_that_cannot_start_is_an_error_saying_what_to_set() -> None:
    process = EngineProcess(EngineSpec({"model": "m"}, "step"), python="/nonexistent/python3")
    with pytest.raises(NoPythonForEngineProcess, match=f"set {PYTHON_ENV} to a Python"):
        process.start_engine()
    assert issubclass(NoPythonForEngineProcess, EngineProcessError)


def test_the_v1_engine_process_gets_a_source_checkout_on_its_path_but_never_a_site_packages_folder() -> None:
    """A site-packages folder on the V1 Python's PYTHONPATH would put this environment's vLLM 0.8.5,
    torch and numpy 1 ahead of the V1 environment's own (the image installs the package there too)."""
    assert v1_import_path("/work/checkout/backend") == {"PYTHONPATH": "/work/checkout/backend"}
    assert v1_import_path("/usr/local/lib/python3.10/dist-packages") == {}
    assert v1_import_path("/opt/venv/lib/python3.10/site-packages") == {}


def test_the_v1_engine_process_finds_the_v1_environment_as_the_other_v1_processes_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The variable (the launcher and the image set it), else the .venv-v1 beside this environment (a
    tritonserver started without the launcher), else an error saying both."""
    monkeypatch.setenv(V1_PYTHON_ENV, "/opt/vllm-v1/bin/python")
    assert EngineProcess(EngineSpec({"model": "m"}, "step"), v1=True)._python == "/opt/vllm-v1/bin/python"
    monkeypatch.delenv(V1_PYTHON_ENV)
    beside = tmp_path / ".venv-v1" / "bin" / "python"
    beside.parent.mkdir(parents=True)
    beside.write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    assert EngineProcess(EngineSpec({"model": "m"}, "step"), v1=True)._python == str(beside)
    beside.unlink()
    with pytest.raises(NoPythonForEngineProcess, match=f"{V1_PYTHON_ENV} is not set .* and there is no .venv-v1"):
        EngineProcess(EngineSpec({"model": "m"}, "step"), v1=True).start_engine()
