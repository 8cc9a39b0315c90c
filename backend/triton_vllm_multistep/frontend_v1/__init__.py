"""The OpenAI server of a `vllm_engine: v1` model (runs in `.venv-v1`, under vLLM 0.32).

A process of its own per V1 model, started and routed to by the multi-step models' OpenAI server
(frontend/): vLLM 0.32's own OpenAI serving code, tokenizer and chat template, on an EngineClient that
streams from the Triton model over gRPC (frontend/triton_stream.py, shared by both servers).
"""
