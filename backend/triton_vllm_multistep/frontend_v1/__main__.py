"""`python -m triton_vllm_multistep.frontend_v1`: one V1 model's OpenAI server (`.venv-v1`'s Python)."""

import sys

from triton_vllm_multistep.frontend_v1.server import main

sys.exit(main())
