"""Test and benchmark tools: a real tritonserver on free ports, per-phase step timing, engine
fault injection. Not used when serving, except that the engine thread arms the fault hook
when (and only when) the test environment variable is set.
"""
