"""An OpenAI server's output tap (output_tap.py): the Unix socket its models' stubs write its requests'
data responses to, instead of sending them through tritonserver's gRPC.

Owns the socket (in a directory of its own, readable by this user only, removed at close), the
connections the stubs make (greeted, then read frame by frame), and one inbox per request key: each
entry goes to its request's inbox in the order the stub wrote it; entries for a key no longer open
(its client went away) are dropped. Imports no vLLM or torch: either OpenAI server runs it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from triton_vllm_multistep.output_tap import GREETING, HEADER_BYTES, decode_frame, frame_length

logger = logging.getLogger("triton_vllm_multistep.frontend")
# Set to 0 to have every response come through tritonserver's gRPC (the OpenAI servers read it).
TAP_ENV = "TRITON_VLLM_MULTISTEP_OUTPUT_TAP"


def tap_wanted(environ: Any = os.environ) -> bool:
    return environ.get(TAP_ENV, "1") != "0"


@dataclass(frozen=True)
class TapItem:
    """One data response of a request, as its stub wrote it to the tap."""

    values: dict[str, list[Any]]
    final: bool  # its last data response: the request's Triton FINAL follows


class OutputTap:
    """The tap socket of one OpenAI server; `path` is what requests name (None until started)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._directory: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._inboxes: dict[str, asyncio.Queue[Any]] = {}
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._directory = tempfile.mkdtemp(prefix="tvm-tap-")  # mode 0700
        path = os.path.join(self._directory, "outputs.sock")
        self._server = await asyncio.start_unix_server(self._serve, path)
        self.path = path

    def open(self, key: str) -> asyncio.Queue[Any]:
        """The inbox of a request about to be sent with this key."""
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._inboxes[key] = inbox
        return inbox

    def forget(self, key: str) -> None:
        self._inboxes.pop(key, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            self._server = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        self.path = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            writer.write(GREETING)
            await writer.drain()
            while True:
                header = await reader.readexactly(HEADER_BYTES)
                for key, values, final in decode_frame(await reader.readexactly(frame_length(header))):
                    inbox = self._inboxes.get(key)
                    if inbox is not None:
                        inbox.put_nowait(TapItem(values, final))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the stub closed it (its model unloaded)
        except asyncio.CancelledError:
            # Only close() cancels a connection; ending quietly, as asyncio 3.11 logs a cancelled
            # connection handler as an unhandled error.
            return
        except Exception:
            logger.exception("an output tap connection sent what is not a frame: closing it")
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()
