"""Draining requests on unload and server stop: the workaround for Triton 2.51's shutdown
behaviour (see docs/lifecycle.md), in one folder so it can be removed in one go after a
Triton upgrade. `protocol` holds the drain file format and every timing constant; `drain` is
the model side, `server_drain` the launcher / `drain` command side, `triton_command` and
`procfs` read the server's processes (testing.local_server finds processes through them too:
move those two if this folder goes). Imports neither vLLM nor torch, nor the rest of the package.
"""
