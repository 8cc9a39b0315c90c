"""The shipped GPU smoke check (`python -m triton_vllm_multistep.checks.gpu_smoke`, scripts/gpu_smoke.sh), by section.

Owns the checks a user runs on a GPU host before serving, and the tools they share with the tests
(the event collector, adapters constructed for a model, image prompts, config.pbtxt parameters):
`gpu_smoke.py` (command line, sections), `engines.py`, `collector.py`, `report.py`, `structured.py`,
`lora.py` + `lora_reference.py` + `adapters.py`, `images.py` + `image_prompts.py`, `pbtxt.py`. Must not
start Triton, and imports nothing from the stub, the host tools, the OpenAI server or testing/.
"""
