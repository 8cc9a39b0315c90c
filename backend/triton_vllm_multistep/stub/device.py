"""Which accelerator a process can use, decided without importing torch or CUDA.

Owns GPU visibility and per-instance device selection; must not initialise CUDA.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DEV = Path("/dev")


def gpu_count(environ: dict[str, str] | None = None, dev: Path = DEV) -> int:
    """NVIDIA GPUs this process could use: device nodes, narrowed by CUDA_VISIBLE_DEVICES."""
    env = os.environ if environ is None else environ
    forced = env.get("TRITON_VLLM_MULTISTEP_DEVICE", "").lower()
    if forced == "cpu":
        return 0
    present = [p for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(present)
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if not entries or entries[0] == "-1":
        return 0
    return min(len(entries), len(present))


def instance_device_environment(kind: str, device_id: int, tensor_parallel: int) -> dict[str, str]:
    """Environment a model instance should run with, given Triton's instance kind and device id.

    KIND_GPU pins the instance to its one GPU; KIND_MODEL leaves device placement to vLLM
    (tensor/pipeline parallel ranks need several GPUs); KIND_CPU uses no GPU at all.
    """
    if kind == "GPU":
        if tensor_parallel > 1:
            raise ValueError(
                "KIND_GPU gives an instance one GPU; tensor/pipeline parallel size "
                f"{tensor_parallel} needs instance_group kind KIND_MODEL"
            )
        return {"CUDA_VISIBLE_DEVICES": str(device_id)}
    if kind == "CPU":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if kind == "MODEL":
        return {}
    raise ValueError(f"unsupported instance kind {kind!r}; use KIND_GPU, KIND_MODEL or KIND_CPU")
