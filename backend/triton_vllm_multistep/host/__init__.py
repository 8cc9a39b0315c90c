"""Host-side tools: the CLI and the launcher that starts tritonserver. Never imports vLLM or torch.
"""
