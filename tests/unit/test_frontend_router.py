"""frontend/router.py: one OpenAI port for the models of both engines, over real HTTP servers.

A stand-in for a V1 model's server and one for the multi-step models' app (small Starlette apps
under uvicorn), the router in front under uvicorn too, a real HTTP client: requests go by the model
they name, streams come back chunk by chunk, a client that goes away ends the request on the V1
model's server, `/v1/models` and `/health` cover both, a V1 server that is gone is a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from triton_vllm_multistep.frontend.router import ModelRouter

V1_MODEL, LOCAL_MODEL = "on_v1", "multistep"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class V1Standin:
    """A V1 model's server: lists its model, streams three chunks (or one whole answer), records requests."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.gone = asyncio.Event()  # a streamed request's client went away
        self.headers: list[dict] = []

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            if request.headers.get("authorization") != "Bearer key":
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            return JSONResponse({"object": "list", "data": [{"id": V1_MODEL}, {"id": f"{V1_MODEL}_lora_a"}]})

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if not body.get("stream"):
                return JSONResponse({"served_by": "v1", "model": body["model"]})

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    for part in ("a", "b", "c"):
                        yield f"data: {part}\n\n".encode()
                        await asyncio.sleep(float(body.get("pause", 0.01)))
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.gone.set()
                    raise

            return StreamingResponse(chunks(), media_type="text/event-stream")

        async def health(_: Request) -> Response:
            return Response(status_code=200)

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/health", health),
            ]
        )


def local_app(healthy: bool = True) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": LOCAL_MODEL}]})

    async def completions(request: Request) -> Response:
        return JSONResponse({"served_by": "local", "model": (await request.json()).get("model")})

    async def health(_: Request) -> Response:
        return Response(status_code=200 if healthy else 503)

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
        ]
    )


@contextlib.asynccontextmanager
async def serving(app: object) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def routed(local: object | None, v1: V1Standin | None) -> AsyncIterator[str]:
    async with contextlib.AsyncExitStack() as stack:
        remote = {}
        if v1 is not None:
            url = await stack.enter_async_context(serving(v1.app()))
            remote = {V1_MODEL: url, f"{V1_MODEL}_lora_a": url}
        else:
            remote = {V1_MODEL: f"http://127.0.0.1:{free_port()}"}  # nothing listens there
        yield await stack.enter_async_context(serving(ModelRouter(local, remote)))


@pytest.fixture
def router_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The router's log lines. Its logger's handler is attached directly: the package's logger stops
    propagating to the root (and caplog's handler there) once stub/instance.py is imported in this process."""
    logger = logging.getLogger("triton_vllm_multistep.frontend")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=logger.name)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def test_requests_go_to_the_server_of_the_model_they_name_and_streams_come_back_chunk_by_chunk(
    router_log: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        v1 = V1Standin()
        async with routed(local_app(), v1) as url, httpx.AsyncClient(base_url=url) as client:
            for model, served_by in (
                (V1_MODEL, "v1"),
                (f"{V1_MODEL}_lora_a", "v1"),
                (LOCAL_MODEL, "local"),
                ("x", "local"),
            ):
                answer = await client.post("/v1/completions", json={"model": model, "prompt": "hi"})
                assert answer.status_code == 200 and answer.json() == {"served_by": served_by, "model": model}
            body = {"model": V1_MODEL, "prompt": "hi", "stream": True, "max_tokens": 3}
            headers = {"authorization": "Bearer key", "x-request-id": "r1"}
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as streamed:
                assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
                lines = [line async for line in streamed.aiter_lines() if line]
            assert lines == ["data: a", "data: b", "data: c", "data: [DONE]"]
            assert v1.bodies[-1] == body  # passed on as sent, with the client's headers
            assert v1.headers[-1]["authorization"] == "Bearer key" and v1.headers[-1]["x-request-id"] == "r1"

    asyncio.run(run())
    assert "went away" not in router_log.text  # a whole answer is no client leaving


def test_a_client_going_away_ends_the_request_on_the_v1_models_server(router_log: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        v1 = V1Standin()
        async with routed(local_app(), v1) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"model": V1_MODEL, "prompt": "hi", "stream": True, "pause": 5}
            async with client.stream("POST", "/v1/completions", json=body) as streamed:
                async for line in streamed.aiter_lines():
                    if line:
                        break  # the first chunk read, the client leaves
            await asyncio.wait_for(v1.gone.wait(), 3)

    asyncio.run(run())
    assert "the client of /v1/completions went away mid-answer" in router_log.text


def test_models_and_health_cover_every_server() -> None:
    async def run() -> None:
        v1 = V1Standin()
        async with routed(local_app(), v1) as url, httpx.AsyncClient(base_url=url) as client:
            listed = await client.get("/v1/models", headers={"authorization": "Bearer key"})
            assert [card["id"] for card in listed.json()["data"]] == [LOCAL_MODEL, V1_MODEL, f"{V1_MODEL}_lora_a"]
            refused = await client.get("/v1/models")  # the V1 server's own refusal, as it answered
            assert refused.status_code == 401
            assert (await client.get("/health")).status_code == 200
        async with routed(local_app(healthy=False), v1) as url, httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).status_code == 503

    asyncio.run(run())


def test_without_multistep_models_every_request_goes_to_the_v1_server_and_a_gone_one_is_a_503() -> None:
    async def run() -> None:
        v1 = V1Standin()
        async with routed(None, v1) as url, httpx.AsyncClient(base_url=url) as client:
            answer = await client.post("/v1/completions", json={"model": "unknown", "prompt": "hi"})
            assert answer.json() == {"served_by": "v1", "model": "unknown"}  # its own checks answer it
            listed = await client.get("/v1/models", headers={"authorization": "Bearer key"})
            assert [card["id"] for card in listed.json()["data"]] == [V1_MODEL, f"{V1_MODEL}_lora_a"]
        async with routed(local_app(), None) as url, httpx.AsyncClient(base_url=url) as client:
            gone = await client.post("/v1/completions", json={"model": V1_MODEL, "prompt": "hi"})
            assert gone.status_code == 503 and gone.json()["type"] == "ServiceUnavailableError"
            assert (await client.get("/health")).status_code == 503
            local = await client.post("/v1/completions", content=json.dumps({"model": LOCAL_MODEL}))
            assert local.json()["served_by"] == "local"

    asyncio.run(run())
