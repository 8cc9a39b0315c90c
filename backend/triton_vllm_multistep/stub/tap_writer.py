"""The stub's side of the output tap (output_tap.py): its connections to the OpenAI servers' tap sockets.

Owned by the response thread alone (no lock). A request that names a tap has its transport decided at
its first response: the tap's connection (made then, or already open), or, when nothing answers there
with the tap's greeting, Triton as if it had named none (the OpenAI server reads either), that socket
then left alone for RETRY_SECONDS. Its later responses take the same way: a request whose connection
has failed since fails too (its next responses could not follow its earlier ones in order). Each
engine step writes one frame per socket, holding every tapped response of that step.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from triton_vllm_multistep.output_tap import GREETING, TapEntry, encode_frame

logger = logging.getLogger(__name__)
# The response thread waits at most this long for a new socket's greeting (a local server's loop
# answers in milliseconds), and for a frame's write (the OpenAI server reading nothing for this long
# ends the connection and fails its requests rather than holding every response of the model).
CONNECT_SECONDS = 2.0
SEND_SECONDS = 10.0
RETRY_SECONDS = 5.0
CONNECTED_MESSAGE = "data responses of the requests that name it now go to output tap"


def plain_values(arrays: Mapping[str, np.ndarray]) -> dict[str, list[Any]]:
    """A response's output arrays as the OpenAI server reads Triton's (triton_stream.response_values):
    BYTES elements as bytes, numbers as Python numbers."""
    values: dict[str, list[Any]] = {}
    for name, array in arrays.items():
        if array.dtype == np.object_:
            values[name] = [item.encode("utf-8") if isinstance(item, str) else bytes(item) for item in array.ravel()]
        else:
            values[name] = array.ravel().tolist()
    return values


class TapWriters:
    """The response thread's tap connections, one per socket path."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sockets: dict[str, tuple[int, socket.socket]] = {}  # path → (connection id, socket)
        self._unreachable_until: dict[str, float] = {}
        self._next_id = 1

    def connection(self, path: str) -> int | None:
        """The id of the open connection to `path`, made now if there is none; None if nothing there
        answers as a tap (then not tried again for RETRY_SECONDS)."""
        live = self._sockets.get(path)
        if live is not None:
            return live[0]
        if self._clock() < self._unreachable_until.get(path, 0.0):
            return None
        try:
            connection = self._connect(path)
        except OSError as error:
            logger.warning(
                "output tap %s does not answer (%s): its requests' responses go through Triton for %.0f s",
                path,
                error,
                RETRY_SECONDS,
            )
            self._unreachable_until[path] = self._clock() + RETRY_SECONDS
            return None
        connection_id, self._next_id = self._next_id, self._next_id + 1
        self._sockets[path] = (connection_id, connection)
        logger.info("%s %s", CONNECTED_MESSAGE, path)
        return connection_id

    def connection_id(self, path: str) -> int | None:
        """The open connection's id, without connecting."""
        live = self._sockets.get(path)
        return None if live is None else live[0]

    def send(self, path: str, entries: Sequence[TapEntry]) -> None:
        """One frame to `path`'s open connection; on failure the connection is closed and OSError raised."""
        live = self._sockets.get(path)
        if live is None:
            raise OSError(f"output tap {path} is not connected")
        try:
            # MSG_NOSIGNAL: a reader gone is an EPIPE error here, never a SIGPIPE to the stub process.
            live[1].sendall(encode_frame(entries), socket.MSG_NOSIGNAL)
        except OSError:
            self._drop(path)
            raise

    def close(self) -> None:
        for path in list(self._sockets):
            self._drop(path)

    def _drop(self, path: str) -> None:
        _, connection = self._sockets.pop(path)
        try:
            connection.close()
        except OSError:
            pass

    @staticmethod
    def _connect(path: str) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(CONNECT_SECONDS)
            connection.connect(path)
            greeting = b""
            while len(greeting) < len(GREETING):
                part = connection.recv(len(GREETING) - len(greeting))
                if not part:
                    break
                greeting += part
            if greeting != GREETING:
                raise OSError("not an output tap (no greeting)")
            connection.settimeout(SEND_SECONDS)
            return connection
        except BaseException:
            connection.close()
            raise
