"""Stream a completion with tritonclient.grpc.aio, printing tokens as they arrive.

python client_examples/grpc_aio_stream.py "The model streams" --model ensemble --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np
import tritonclient.grpc.aio as grpcclient


def build_inputs(prompt: str, sampling: dict) -> list[grpcclient.InferInput]:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    return [text, stream, params]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="The model streams")
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--model", default="vllm_model", help="vllm_model or ensemble")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}

    async def requests():
        yield {"model_name": args.model, "inputs": build_inputs(args.prompt, sampling)}

    failed = False
    async with grpcclient.InferenceServerClient(args.url) as client:
        # Read to the stream's end, which the server makes right after the final response; do not
        # break out at the final one: Triton 2.51 can lose the state of a stream cancelled as it
        # ends, and keep the model from unloading (docs/lifecycle.md).
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                failed = True
                continue
            print(result.as_numpy("text_output")[0].decode("utf-8"), end="", flush=True)
    print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
