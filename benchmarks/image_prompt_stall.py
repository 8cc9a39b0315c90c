"""How long processing image prompts holds up a running stream (figures, not a test).

One engine loop (CPU multi-step runner, 8 steps, the tiny LLaVA demo model), one text stream running;
then a burst of image requests is submitted, whose prompts vLLM's processor (the model's HF image
processor: resize, rescale, normalise) prepares on the loop's image prompt thread
(engine/multimodal.py). Prints, per image size: the stream's median step gap before the burst, its
longest gap while the burst is processed, and how long vLLM's processing of one such prompt takes
(measured alone on this thread): what each request would add to the engine's step if vLLM's
`add_request` processed it inline, as it does.

    .venv/bin/python -m benchmarks.image_prompt_stall [--sizes 512 2048] [--burst 8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from triton_vllm_multistep.testing.polling import wait_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[512, 2048], help="square image sizes, pixels")
    parser.add_argument("--burst", type=int, default=8, help="image requests submitted at once")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import EngineArgs

    from triton_vllm_multistep.checks import image_prompts as multimodal
    from triton_vllm_multistep.demo import models, tiny_llava
    from triton_vllm_multistep.engine.events import EngineRequest
    from triton_vllm_multistep.engine.factory import build_engine
    from triton_vllm_multistep.engine.loop import EngineLoop, StepOutputs
    from triton_vllm_multistep.engine.multimodal import image_prompt

    model = models.build(tiny_llava.NAME)
    prompt_ids = AutoTokenizer.from_pretrained(model).encode(multimodal.IMAGE_PROMPT)
    engine_args = EngineArgs(model=str(model), dtype="float32", max_model_len=2048, num_scheduler_steps=8)
    loop = EngineLoop(lambda: build_engine(engine_args, stream_mode="step"))
    engine = loop.start_engine()
    times: list[float] = []
    images_done: list[float] = []

    def sink(event: object) -> None:
        if isinstance(event, StepOutputs):
            now = time.perf_counter()
            for output in event.outputs:
                if output.request_id == "plain":
                    times.append(now)
                elif output.finished:
                    images_done.append(now)

    loop.serve(sink)
    delta = "DELTA"
    text = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0, "output_kind": delta}
    loop.submit(EngineRequest("plain", (1, 2, 3), text))
    wait_for(lambda: len(times) >= 30, 300, interval=0.02)
    print(f"tiny-llava, 8 steps, a running text stream; bursts of {args.burst} image requests (max_tokens 1)")
    for size in args.sizes:
        # Distinct images: vLLM caches processed items by their hash.
        burst = [multimodal.noise_image(seed=size + index, size=(size, size)) for index in range(args.burst + 1)]
        started = time.perf_counter()
        engine.input_preprocessor.preprocess(image_prompt(prompt_ids, [burst.pop()]))
        inline = time.perf_counter() - started
        files = [multimodal.image_file(image) for image in burst]  # as the stub sends them (decoded by the engine)
        images_done.clear()
        submitted = time.perf_counter()
        for index in range(args.burst):
            params = {"max_tokens": 1, "temperature": 0, "output_kind": delta}
            loop.submit(EngineRequest(f"image-{size}-{index}", tuple(prompt_ids), params, images=(files[index],)))
        wait_for(lambda: len(images_done) >= args.burst, 600, interval=0.02)
        finished = time.perf_counter()
        count = len(times)
        wait_for(lambda count=count: len(times) >= count + 10, 300, interval=0.02)
        gaps = list(itertools.pairwise(times))
        before = [b - a for a, b in gaps if b < submitted][-50:]
        during = [b - a for a, b in gaps if submitted <= b <= finished + 0.5]
        print(
            f"{size}x{size}: median step gap before {1000 * statistics.median(before):6.1f} ms, longest while "
            f"processing {1000 * max(during):6.1f} ms; one prompt's processing {1000 * inline:6.1f} ms "
            f"(inline in add_request: x{args.burst} = {1000 * inline * args.burst:7.1f} ms in one step); "
            f"burst done in {1000 * (finished - submitted):7.1f} ms"
        )
    loop.shutdown()


if __name__ == "__main__":
    main()
