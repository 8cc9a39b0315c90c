"""The OpenAI-compatible HTTP server that runs beside tritonserver (`serve --openai-port`).

A process of its own (it imports vLLM; the launcher in host/ does not): vLLM 0.8.5's own OpenAI
serving code on an EngineClient that streams from the Triton model over gRPC.
"""
