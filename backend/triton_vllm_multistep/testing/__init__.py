"""Test and benchmark tools: a real tritonserver on free ports with start-up retry
(`local_server`), waiting for a condition (`polling`), per-phase step timing (`step_timing`),
engine fault injection (`faults`). Not used when serving, except that the engine thread arms the
fault hook when (and only when) the test environment variable is set.
"""
