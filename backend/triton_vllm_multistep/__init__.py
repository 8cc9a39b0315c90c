"""Serve vLLM multi-step engines from Triton Inference Server, streaming every decoded step."""
