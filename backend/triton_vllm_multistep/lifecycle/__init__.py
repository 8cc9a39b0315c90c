"""Draining requests on unload and server stop: the workaround for Triton 2.51's shutdown
behaviour (see docs/lifecycle.md), in one folder so it can be removed in one go after a
Triton upgrade. `protocol` holds the drain file format and every timing constant.
Imports neither vLLM nor torch.
"""
