"""Temporary: what testing/gpu_smoke.py still imports from here (it is being moved into a package of
its own in parallel); multi_lora.json is read by settings/lora.py. Delete with testing/gpu_smoke.py.
"""

from __future__ import annotations

from triton_vllm_multistep.settings.lora import local_model_dir

__all__ = ["local_model_dir"]
