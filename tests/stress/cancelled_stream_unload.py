"""Triton 2.51's gRPC frontend and streams cancelled as they end: does the model still unload?

A client of a decoupled model that cancels its gRPC stream right after the FINAL (tritonclient's
aio `stream_infer` left with `break`, its channel then closed) races the server finishing that
stream; Triton 2.51 can lose the stream's state in that race (fixed upstream in 25.04, server PR
8078), and the lost state holds the model (its request keeps a reference), so the model's unload
never completes and the server's stop runs into its exit timeout. A client that reads the stream
to the end the server makes (what this project's OpenAI server and test clients do) leaves nothing.

Not a pytest module (each round loads and unloads a model). Usage:
    .venv/bin/python tests/stress/cancelled_stream_unload.py --ending cancel|read [--rounds 5]

Each round: load a tiny multi-step model, three batches of 32 concurrent streams (40 tokens each),
unload it, and wait up to 60 s for its stub to exit. Prints one line per round; exits 1 when a
model did not unload (with --ending cancel that is the race reproduced, not a failure of ours).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from private_servers import make_repository
from triton_clients import make_inputs

from triton_vllm_multistep.testing.local_server import start_ready_server
from triton_vllm_multistep.testing.polling import wait_for

MODEL = "streamed"
STREAMS = 32
BATCHES = 3
SAMPLING = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}


async def one_stream(client: grpcaio.InferenceServerClient, index: int, cancel_after_final: bool) -> int:
    inputs = make_inputs(grpcaio, prompt=f"stream {index} tells a story", sampling=SAMPLING, stream=True)

    async def requests():
        yield {"model_name": MODEL, "inputs": inputs, "enable_empty_final_response": True}

    finals = 0
    async for item, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(error)
        if item.get_response().parameters["triton_final_response"].bool_param:
            finals += 1
            if cancel_after_final:
                break  # the stream is cancelled when the iterator is dropped and the channel closed
    return finals


async def one_batch(url: str, cancel_after_final: bool) -> list[int]:
    async with grpcaio.InferenceServerClient(url) as client:
        return await asyncio.gather(*[one_stream(client, i, cancel_after_final) for i in range(STREAMS)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ending", choices=("cancel", "read"), required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cancelled-stream-unload-"))
    repository = make_repository(root, {MODEL: {"parameters": {"stream_mode": "merge"}}})
    server, _ = start_ready_server(repository, root / "tritonserver.log", "--model-control-mode=explicit")
    stuck = 0
    try:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for round_index in range(args.rounds):
                client.load_model(MODEL)
                for _ in range(BATCHES):
                    finals = asyncio.run(one_batch(server.grpc_url, args.ending == "cancel"))
                    assert finals == [1] * STREAMS, finals
                client.unload_model(MODEL)
                started = time.monotonic()
                gone = wait_for(lambda: not server.running_with(f"/{MODEL}/1/model.py"), 60)
                took = time.monotonic() - started
                print(f"round {round_index}: {'unloaded' if gone else 'NOT unloaded'} ({took:.1f} s)", flush=True)
                if not gone:
                    stuck += 1
                    break  # the model stays loaded: later rounds cannot load it again
    finally:
        server.stop()
        if stuck:
            print(f"server log: {server.log_path}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"ending={args.ending}: {stuck} stuck unload(s) in {round_index + 1} round(s)")
    return 1 if stuck else 0


if __name__ == "__main__":
    sys.exit(main())
