"""`python -m triton_vllm_multistep` is the `triton-vllm-multistep` command."""

import sys

from .cli import main

sys.exit(main())
