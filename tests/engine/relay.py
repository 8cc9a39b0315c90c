"""One engine process shared by the engine tests of a module, its events handed to each test's sink."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton_vllm_multistep.engine.process import EngineProcess


class Relay:
    """One engine process served once (each EngineProcess.serve starts an event reader of its own),
    its events handed to the sink of the test of the moment: the tests that need a working engine
    share one process instead of starting one each (a start imports vLLM in the child and builds)."""

    def __init__(self, process: EngineProcess) -> None:
        self.process = process
        self.sink: Callable[[Any], None] = lambda _event: None
        self.on_state: Callable[[Any], None] = lambda _state: None
        process.serve(lambda event: self.sink(event), on_state=lambda state: self.on_state(state), time_steps=True)

    def to(self, sink: Callable[[Any], None], on_state: Callable[[Any], None] = lambda _state: None) -> None:
        self.sink, self.on_state = sink, on_state
