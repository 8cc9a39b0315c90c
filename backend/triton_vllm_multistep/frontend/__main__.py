"""`python -m triton_vllm_multistep.frontend`: the OpenAI server beside a running tritonserver."""

import sys

from triton_vllm_multistep.frontend.server import main

sys.exit(main())
