"""Stream a completion from the LLM model over gRPC (tritonclient.grpc), printing tokens as they arrive.

python client_examples/grpc_stream.py "The model streams" --max-tokens 32
python client_examples/grpc_stream.py "What is the capital of France?" --model ensemble --chat
python client_examples/grpc_stream.py "Is Paris in France?" --model ensemble --chat \
    --guided-decoding '{"choice": ["yes", "no"]}'
python client_examples/grpc_stream.py "What is the capital of France?" --model ensemble --chat --lora-name pirate
python client_examples/grpc_stream.py $'USER: <image>\nWhat is in the picture? ASSISTANT:' --image cat.png
python client_examples/grpc_stream.py "The capital of France is" --perf-metrics --prompt-logprobs 1
python client_examples/grpc_stream.py "The capital of France is" --priority -1  # scheduling_policy "priority"
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

PERF_TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def build_inputs(
    prompt: str,
    sampling: dict,
    stream: bool = True,
    chat: bool = False,
    images: list[bytes] | None = None,
    perf_metrics: bool = False,
    priority: int | None = None,
) -> list[grpcclient.InferInput]:
    """The request's inputs; `images` are image files' bytes, one per placeholder of the prompt."""
    if chat:  # one user message; the ensemble's preprocessing applies the model's chat template
        text = grpcclient.InferInput("messages", [1], "BYTES")
        message = json.dumps([{"role": "user", "content": prompt}])
        text.set_data_from_numpy(np.array([message.encode()], dtype=np.object_))
    else:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    stream_flag = grpcclient.InferInput("stream", [1], "BOOL")
    stream_flag.set_data_from_numpy(np.array([stream]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    inputs = [text, stream_flag, params]
    if images:  # multimodal models: base64-encoded, in the order of the prompt's placeholders
        image = grpcclient.InferInput("image", [len(images)], "BYTES")
        image.set_data_from_numpy(np.array([base64.b64encode(data) for data in images], dtype=np.object_))
        inputs.append(image)
    if perf_metrics:  # the LLM model's optional input (an ensemble would have to declare it)
        flag = grpcclient.InferInput("return_perf_metrics", [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        inputs.append(flag)
    if priority is not None:  # lower is scheduled first; the model needs scheduling_policy "priority"
        urgency = grpcclient.InferInput("priority", [1], "INT32")
        urgency.set_data_from_numpy(np.array([priority], dtype=np.int32))
        inputs.append(urgency)
    return inputs


def prompt_logprobs_summary(text: bytes) -> str:
    """The `prompt_logprobs` output: each prompt token after the first, with its most likely candidate."""
    lines = []
    for position, candidates in enumerate(json.loads(text)):
        if candidates is None:
            continue  # the first prompt token has no context
        best = max(candidates.values(), key=lambda entry: entry["logprob"])
        lines.append(f"prompt token {position}: most likely {best['decoded_token']!r} ({best['logprob']:.3f})")
    return "\n".join(lines)


def perf_summary(result: grpcclient.InferResult) -> str:
    """The FINAL response's return_perf_metrics outputs, as milliseconds after the request's arrival."""
    arrival, scheduled, first, last = (int(result.as_numpy(name)[0]) for name in PERF_TIMES)
    cached = int(result.as_numpy("num_cached_tokens")[0])

    def after(stamp: int) -> str:
        return "-" if stamp < 0 else f"{(stamp - arrival) / 1e6:.1f} ms"

    return (
        f"scheduled after {after(scheduled)}, first token after {after(first)}, last token after {after(last)}, "
        f"{cached} prompt tokens from the prefix cache"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="The model streams")
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--model", default="vllm_model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a chat message (ensemble only)")
    parser.add_argument(
        "--guided-decoding",
        metavar="JSON",
        help='structured output, vLLM\'s GuidedDecodingParams as JSON: {"choice": [...]}, {"regex": "..."}, '
        '{"json": {schema}}, {"grammar": "..."} or {"json_object": true}',
    )
    parser.add_argument(
        "--lora-name", help="a LoRA adapter of the model's multi_lora.json (sampling_parameters.lora_name)"
    )
    parser.add_argument(
        "--image", action="append", default=[], metavar="FILE", help="an image for the prompt's next placeholder"
    )
    parser.add_argument(
        "--prompt-logprobs", type=int, metavar="N", help="print the prompt's logprobs, N candidates per token"
    )
    parser.add_argument("--priority", type=int, help="the request's priority (lower first; 0 by default)")
    parser.add_argument(
        "--perf-metrics",
        action="store_true",
        help="print the request's timings and prefix-cache use after the answer (return_perf_metrics)",
    )
    args = parser.parse_args()

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.guided_decoding:
        sampling["guided_decoding"] = args.guided_decoding  # a JSON string, as Triton's vLLM backend takes it
    if args.lora_name:
        sampling["lora_name"] = args.lora_name
    if args.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = args.prompt_logprobs
    images = [Path(path).read_bytes() for path in args.image]
    inputs = build_inputs(
        args.prompt, sampling, chat=args.chat, images=images, perf_metrics=args.perf_metrics, priority=args.priority
    )
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    status = 0
    shown_after = ""
    while True:
        result, error = responses.get()
        if error is not None:
            print(f"\nerror: {error}", file=sys.stderr)
            status = 1
            break
        response = result.get_response()
        output = result.as_numpy("text_output")
        if output is not None:
            print(output[0].decode("utf-8"), end="", flush=True)
        prompt_logprobs = result.as_numpy("prompt_logprobs")
        if prompt_logprobs is not None:  # on the first response; shown after the answer
            shown_after = prompt_logprobs_summary(prompt_logprobs[0])
        if response.parameters["triton_final_response"].bool_param:
            if shown_after:
                print(f"\n{shown_after}", end="")
            if args.perf_metrics and result.as_numpy(PERF_TIMES[0]) is not None:
                print(f"\n{perf_summary(result)}", end="")
            break
    print()
    client.stop_stream()
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InferenceServerException as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
