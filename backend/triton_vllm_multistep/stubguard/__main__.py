import sys

from triton_vllm_multistep.stubguard.guard import main

sys.exit(main(sys.argv[1:]))
