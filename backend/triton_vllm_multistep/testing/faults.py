"""Test-only fault injection, installed from outside through engine/extensions.py: the engine's
forward pass raises, the engine process exits, or a response send fails, when a file says so.

Owns the switches (files next to the one FAULT_FILE_ENV names) and the patches that act on them;
armed only from the server's environment (`server_environment`), never from a request. Product
modules import nothing of this.

Files, checked at every forward pass or send (`<fault>` is the FAULT_FILE_ENV path):
- `<fault>`: every model's next forward pass raises InjectedEngineFault;
- `<fault>.<model>`: that Triton model's next forward pass raises;
- `<fault>.<model>.exit`: that model's engine exits its process at the next forward pass
  (the engine process, or the stub itself for an engine in the stub);
- `<fault>.<model>.send`: the next response send of each of that model's requests raises (as
  Triton's IPC can), once per request.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from triton_vllm_multistep.engine.extensions import HOOKS_ENV, MODEL_NAME_ENV

logger = logging.getLogger(__name__)

FAULT_FILE_ENV = "TRITON_VLLM_MULTISTEP_TEST_ENGINE_FAULT_FILE"
EXIT_CODE = 17  # an engine process ended by `<fault>.<model>.exit`


class InjectedEngineFault(RuntimeError):
    """Raised inside the engine's forward pass by the test-only fault injection."""


class InjectedSendFault(RuntimeError):
    """Raised by a response send by the test-only fault injection."""


def server_environment(fault_file: Path) -> dict[str, str]:
    """The environment a test server needs for these faults (the stubs and engines inherit it)."""
    return {HOOKS_ENV: __name__, FAULT_FILE_ENV: str(fault_file)}


def model_fault_file(fault_file: Path, model: str, kind: str = "") -> Path:
    """The switch for one model: `kind` "" (forward pass raises), "exit" or "send"."""
    return fault_file.with_name(f"{fault_file.name}.{model}" + (f".{kind}" if kind else ""))


def install() -> None:
    """engine/extensions.py's entry: patch the engine loop (and, in a stub, the responder)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        raise RuntimeError(f"{__name__} is installed but {FAULT_FILE_ENV} is not set")
    fault_file = Path(path)
    # At the loop's own import, not now: importing it imports vLLM (~10 s), which a stub that
    # refuses its settings before building an engine would otherwise pay for these hooks' sake.
    _when_imported("triton_vllm_multistep.engine.loop", lambda loop: _patch_engine_loop(loop, fault_file))
    if "triton_python_backend_utils" in sys.modules:  # a stub (model.py imported it): it sends responses
        _patch_responder(fault_file)


def _model() -> str:
    return os.environ.get(MODEL_NAME_ENV, "")


class _PatchAtImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands back the spec of module `name` with `patch` run on the module
    right after it executes, then leaves sys.meta_path."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def _when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run `patch` on module `name` now if it is imported, else right after its first import."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchAtImport(name, patch))


def _patch_engine_loop(loop: ModuleType, fault_file: Path) -> None:
    serve = loop.EngineLoop.serve

    def serve_with_faults(self: Any, *args: Any, **kwargs: Any) -> None:
        model = loop.driver_model(self.engine)
        if model is not None:
            model.register_forward_pre_hook(_forward_fault(fault_file, _model()))
            logger.warning("test-only engine fault injection is armed for model %r: %s", _model(), fault_file)
        serve(self, *args, **kwargs)

    loop.EngineLoop.serve = serve_with_faults


def _forward_fault(fault_file: Path, model: str):
    raises = (fault_file, model_fault_file(fault_file, model))
    exits = model_fault_file(fault_file, model, "exit")

    def maybe_fail(*_: object) -> None:
        if exits.exists():
            logger.warning("injected fault: the engine of model %r exits its process", model)
            os._exit(EXIT_CODE)
        if any(path.exists() for path in raises):
            raise InjectedEngineFault(f"injected engine fault ({FAULT_FILE_ENV})")

    return maybe_fail


class _FailingSender:
    """A response sender whose first send after the model's send switch appears raises, once per
    request, as Triton 2.51's can: a response that is not FINAL is lost (as when the IPC fails), a
    FINAL is delivered and then reported failed (the stub closes its sender before the IPC, and the
    server reports its own errors after handling the FINAL: response_sender.cc)."""

    def __init__(self, sender: Any, switch: Path) -> None:
        self._sender = sender
        self._switch = switch
        self._failed = False

    def send(self, response: Any = None, flags: int = 0) -> Any:
        if self._failed or not self._switch.exists():
            return self._sender.send(response, flags=flags)
        self._failed = True
        if flags:  # TRITONSERVER_RESPONSE_COMPLETE_FINAL, the only flag there is
            self._sender.send(response, flags=flags)
        raise InjectedSendFault(f"injected send fault ({self._switch})")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sender, name)


def _patch_responder(fault_file: Path) -> None:
    from triton_vllm_multistep.stub import responder

    register = responder.Responder.register

    def register_with_faults(self: Any, request_id: str, state: Any) -> bool:
        state.sender = _FailingSender(state.sender, model_fault_file(fault_file, _model(), "send"))
        return register(self, request_id, state)

    responder.Responder.register = register_with_faults
