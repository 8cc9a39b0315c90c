"""One OpenAI port for the models of both engines: each request to the server of the model it names.

Owns routing on the OpenAI port (an ASGI app in front of vLLM 0.8.5's): a request whose JSON body
names a `vllm_engine: v1` model (or one of its adapters) is passed to that model's own server
(frontend_v1/, on a local port) and its answer streamed back as it comes, the client's going away
closing it there too (which aborts the request in the engine); every other request goes to the
multi-step models' app (or, when there are none, to the first V1 model's server, whose own checks
answer it). `/v1/models` lists the models of all servers; `/health` is 200 only while all are.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

logger = logging.getLogger("triton_vllm_multistep.frontend")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Headers that belong to one connection, not to the message passed on.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"host", b"te"})


class ModelRouter:
    """ASGI app: `remote` maps each served name (a V1 model, its adapters) to its server's base URL."""

    def __init__(self, local: App | None, remote: Mapping[str, str]) -> None:
        if local is None and not remote:
            raise ValueError("nothing to route to")
        self._local = local
        self._remote = dict(remote)
        self._servers = list(dict.fromkeys(self._remote.values()))
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:  # made on the serving loop
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        return self._http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] != "http":
            if self._local is not None:
                await self._local(scope, receive, send)
        elif scope["method"] == "GET" and scope["path"] == "/v1/models":
            await self._models(scope, receive, send)
        elif scope["path"] == "/health":
            await self._health(scope, receive, send)
        elif scope["method"] == "POST":
            body = await _read_body(receive)
            target = self._remote.get(_named_model(body))
            if target is None and self._local is not None:
                await self._local(scope, _replay(body, receive), send)
            else:
                await self._proxy(target or self._servers[0], scope, body, receive, send)
        elif self._local is not None:
            await self._local(scope, receive, send)
        else:
            await self._proxy(self._servers[0], scope, b"", receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._local is not None:
            try:
                await self._local(scope, receive, send)
            finally:
                await self.aclose()
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _answers(self, scope: Scope) -> list[tuple[int, bytes]]:
        """(status, body) of this GET from every server: the multi-step app's, then each V1 model's."""
        answers = [await self._local_answer(scope)] if self._local is not None else []
        return answers + [await self._remote_answer(server, scope) for server in self._servers]

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every server's model list in one; a server's refusal (a wrong API key) answered as is."""
        answers = await self._answers(scope)
        refused = next(((status, body) for status, body in answers if status != 200), None)
        if refused is not None:
            await _respond(send, *refused)
            return
        cards = [card for _, body in answers for card in json.loads(body).get("data", [])]
        await _respond(send, 200, json.dumps({"object": "list", "data": cards}).encode())

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        answers = await self._answers(scope)
        failed = next(((status, body) for status, body in answers if status != 200), None)
        await _respond(send, *(failed or (200, b"")))

    async def _local_answer(self, scope: Scope) -> tuple[int, bytes]:
        assert self._local is not None
        status, parts = 500, []

        async def capture(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self._local(scope, _replay(b"", _never), capture)
        return status, b"".join(parts)

    async def _remote_answer(self, server: str, scope: Scope) -> tuple[int, bytes]:
        try:
            response = await self.http.get(server + scope["path"], headers=_passed_headers(scope))
        except httpx.HTTPError as error:
            return 503, _unavailable(
                f"the OpenAI server of a vllm_engine 'v1' model ({server}) did not answer: {error}"
            )
        return response.status_code, response.content

    async def _proxy(self, server: str, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """The request to `server`, its answer streamed back; stopped (and the request with it, closing
        the connection there) as soon as the client goes away."""
        query = scope.get("query_string", b"").decode("latin-1")
        url = server + scope["path"] + (f"?{query}" if query else "")
        request = self.http.build_request(scope["method"], url, headers=_passed_headers(scope), content=body)

        started = answered = False  # answered: the whole answer was sent on
        gone = asyncio.Event()  # the client went away (uvicorn also says so once the answer is complete)

        async def relay() -> None:
            nonlocal started, answered
            response = await self.http.send(request, stream=True)
            try:
                headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
                started = True
                await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
                async for chunk in response.aiter_raw():
                    # uvicorn's send to a client that is gone returns without error: were this task's
                    # cancellation lost (a library swallowing it), the rest would be relayed to nobody.
                    if gone.is_set():
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                answered = True
            finally:
                await response.aclose()  # unread: closes the connection, which stops the request there

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        relaying, watching = asyncio.ensure_future(relay()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait((relaying, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relaying, watching):
                task.cancel()
            await asyncio.gather(relaying, watching, return_exceptions=True)
        if gone.is_set() and started and not answered:
            logger.info("the client of %s went away mid-answer: its request to %s stopped", scope["path"], server)
        error = relaying.exception() if relaying.done() and not relaying.cancelled() else None
        if error is None:
            return
        if not isinstance(error, httpx.HTTPError):
            raise error
        if started:  # cut off mid-answer: the client sees its stream end early
            logger.warning("the OpenAI server at %s broke off an answer: %s", server, error)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await _respond(send, 503, _unavailable(f"the OpenAI server of a vllm_engine 'v1' model failed: {error}"))


def _unavailable(message: str) -> bytes:
    """vLLM's error body for a 503."""
    return json.dumps({"object": "error", "message": message, "type": "ServiceUnavailableError", "code": 503}).encode()


def _named_model(body: bytes) -> str:
    try:
        value = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError):
        return ""  # not a JSON object: the app answers it
    return value if isinstance(value, str) else ""


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out `body` once, then what the client sends next (its going away)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def _passed_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP and k.lower() != b"content-length"]


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
