"""A test's own output tap (frontend/tap_listener.py) on an event loop of its own thread, as an OpenAI
server runs one: a test names its socket in a request and reads what the stub wrote there."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from triton_vllm_multistep.frontend.tap_listener import OutputTap, TapItem


class TapThread:
    """A started OutputTap; `path` is its socket. close() ends it and its thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="output-tap", daemon=True)
        self._thread.start()
        self.tap = OutputTap()
        self.call(self.tap.start())

    @property
    def path(self) -> str:
        assert self.tap.path is not None
        return self.tap.path

    def call(self, coroutine: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def inbox(self, key: str) -> asyncio.Queue:
        async def opened() -> asyncio.Queue:
            return self.tap.open(key)

        return self.call(opened())

    def items(self, inbox: asyncio.Queue, count: int, timeout: float = 10.0) -> list[TapItem]:
        """The next `count` entries of an inbox (TimeoutError when they do not come)."""

        async def taken() -> list[TapItem]:
            return [await asyncio.wait_for(inbox.get(), timeout) for _ in range(count)]

        return self.call(taken(), timeout * count + 5)

    def until_final(self, inbox: asyncio.Queue, timeout: float = 60.0) -> list[TapItem]:
        """The inbox's entries up to and with the request's last (final) one."""

        async def taken() -> list[TapItem]:
            items = [await asyncio.wait_for(inbox.get(), timeout)]
            while not items[-1].final:
                items.append(await asyncio.wait_for(inbox.get(), timeout))
            return items

        return self.call(taken(), timeout + 5)

    def close(self) -> None:
        self.call(self.tap.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
