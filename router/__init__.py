"""Front door: orchestration of prefill and decode workers (the full router comes on top)."""
