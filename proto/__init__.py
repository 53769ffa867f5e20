"""gRPC protocol of hybridserve (package `hybridserve.v1`): the .proto files and their generated modules.

Regenerate with `python proto/generate.py`; a test checks the committed modules are current.
"""

from hybridserve.proto.hybridserve.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = ["common_pb2", "router_pb2", "router_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
