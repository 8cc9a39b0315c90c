"""A process of its own beside each Python stub that keeps tritonserver from giving up on a stub that
stalls (docs/lifecycle.md, "A stalled stub"); imports only the standard library and lifecycle.procfs."""
