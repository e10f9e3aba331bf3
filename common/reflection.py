"""gRPC server reflection over exactly the services a server implements.

grpcio-reflection answers file and symbol queries from the process's default descriptor pool, which holds every
generated module imported (the router imports worker.proto's stubs to call the worker): a reflection client was
handed files and services the server does not implement. Here the servicer gets a pool of its own, holding only
the implemented services' files, their dependencies, health and reflection.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


def _pool_of(services: Iterable[ServiceDescriptor]) -> descriptor_pool.DescriptorPool:
    """A descriptor pool holding the files that define `services`, with their imports (dependencies first)."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for service in services:
        add(service.file)
    return pool


def enable_reflection(server: grpc.aio.Server, implemented: Iterable[ServiceDescriptor]) -> tuple[str, ...]:
    """Serves reflection on `server` listing `implemented`, health and reflection, and describing nothing else;
    returns the service names it lists."""
    services = (*implemented, HEALTH_SERVICE, REFLECTION_SERVICE)
    names = tuple(s.full_name for s in services)
    reflection.enable_server_reflection(names, server, pool=_pool_of(services))
    return names
