"""The generated gRPC modules, under one import: `from common.pb import router_pb2, worker_pb2_grpc`.

`make proto` (or any `pip install`, through setup.py) generates them from protos/colibri/<service>/v1/*.proto
into common/pb/colibri/<service>/v1/; the code base imports them from here, so a move of the protos touches
this file alone. Loading one side also loads the other: both are small, and every process needs the worker's.
"""
from common.pb.colibri.router.v1 import router_pb2, router_pb2_grpc
from common.pb.colibri.worker.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["router_pb2", "router_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
