"""Namespace of the proto package path `hybridserve.v1`."""
