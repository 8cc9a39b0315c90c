"""vLLM's current engine (V1) for models with config.pbtxt `vllm_engine: v1`.

Runs only in the V1 environment (`.venv-v1`: vLLM 0.32+, numpy 2, transformers 5), in an engine
process the stub starts under that environment's Python (engine/process.py's EngineProcess with
this package's entry). It speaks engine/messages.py's messages and engine/events.py's types, plain
values only, so that nothing of either vLLM crosses between the two environments; it imports
nothing else of this package that could pull in the stub's environment (import-linter says so).
"""
