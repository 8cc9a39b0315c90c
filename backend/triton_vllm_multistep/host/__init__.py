"""Host-side tools: the CLI (`cli`) and the launcher that starts tritonserver (`launcher`);
the `drain` command's work is lifecycle.server_drain. Never imports vLLM or torch.
"""
