"""One non-streaming completion over HTTP (`generate`): the whole text in one JSON response.

python client_examples/http_generate.py "The model streams" --max-tokens 32
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
        "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature}),
    }
    if args.model != "ensemble":
        body["exclude_input_in_output"] = True  # the ensemble never echoes the prompt
    response = requests.post(f"{args.url}/v2/models/{args.model}/generate", json=body)
    result = response.json()
    if response.status_code != 200:
        print(f"error: {result.get('error', result)}", file=sys.stderr)
        return 1
    print(result["text_output"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
