"""Generated protobuf / gRPC modules of package `hybridserve.v1` (do not edit by hand)."""
