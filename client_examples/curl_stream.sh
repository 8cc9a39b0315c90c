#!/usr/bin/env bash
# Stream a completion with curl over HTTP generate_stream (server-sent events, one JSON per token).
#   client_examples/curl_stream.sh "The model streams" [model] [max_tokens] [url]
set -euo pipefail
prompt=${1:-The model streams}
model=${2:-vllm_model}
max_tokens=${3:-32}
url=${4:-http://localhost:8000}
body=$(printf '{"text_input": %s, "stream": true, "sampling_parameters": "{\\"max_tokens\\": %d, \\"temperature\\": 0}"}' \
  "$(printf '%s' "$prompt" | python3 -c 'import json, sys; print(json.dumps(sys.stdin.read()))')" "$max_tokens")
curl --silent --show-error --no-buffer -X POST "$url/v2/models/$model/generate_stream" -d "$body"
