"""`python -m triton_vllm_multistep` is the `triton-vllm-multistep` command."""

import sys

from triton_vllm_multistep.host.cli import main

sys.exit(main())
