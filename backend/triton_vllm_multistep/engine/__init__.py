"""Code that drives vLLM: building the engine (GPU: vLLM's MultiStepWorker; CPU: our runner) and
the engine thread. Knows nothing of Triton; `events` is the boundary and imports no vLLM.
"""
