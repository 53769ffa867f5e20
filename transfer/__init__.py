"""Moving a request's state from a prefill worker to a decode worker: layout, manifest, digests, data planes.

Both workers import this package; neither imports the other. `state_layout` is torch-only (the engine uses
it); the gRPC modules are imported only by whoever needs them.
"""
