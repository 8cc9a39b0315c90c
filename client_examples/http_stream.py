"""Stream a completion over HTTP (`generate_stream`, server-sent events), printing tokens as they arrive.

python client_examples/http_stream.py "The model streams" --model ensemble --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys

import requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="The model streams")
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--model", default="vllm_model", help="vllm_model or ensemble")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    body = {
        "text_input": args.prompt,
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature}),
    }
    with requests.post(f"{args.url}/v2/models/{args.model}/generate_stream", json=body, stream=True) as response:
        for line in response.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                print(f"\nerror: {event['error']}", file=sys.stderr)
                return 1
            print(event["text_output"], end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
