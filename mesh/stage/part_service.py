"""Package parts served to other nodes, block by block (proto/parts.proto).

A node that holds a package's parts runs this service (as a `PartServer` actor, which the
engine starts only when some node lacks its stages' parts). It serves only files its
manifest of the asked model lists, read through one descriptor checked for the manifest's
size; each 1 MiB block goes out with the BLAKE3 of the bytes read, so the receiver can
tell a block damaged on the way and ask for it again. Calls carry the cluster token and,
between nodes, run over mutual TLS, like every stage call (mesh/stage/security.py).
"""

from __future__ import annotations

import logging
import os
from concurrent import futures
from pathlib import Path

import grpc
import ray
from blake3 import blake3

from skippy.cache.blocks import BLOCK_SIZE
from skippy.proto import parts_pb2 as pb
from skippy.proto import parts_pb2_grpc
from skippy.topology.package_part import PackageError, open_part_file, read_at

from .channels import channel_options
from .part_store import holding_dir
from .security import SecretCheck, StageCredentials

log = logging.getLogger(__name__)

MAX_MESSAGE = BLOCK_SIZE + (1 << 16)  # a block and its few fields
WORKERS = 8                           # parts sent at once (one per fetching stage)


class PartsServicer(parts_pb2_grpc.PartsServicer):
    def __init__(self, path: str | Path, model_digest: str):
        """Serves parts of the package of `model_digest` held at `path` or in this node's
        own package folder (mesh/stage/part_store.py)."""
        self.path, self.model_digest = Path(path), model_digest
        self.served = 0  # bytes sent

    def GetPart(self, request, context):
        held = None
        if request.model_digest == self.model_digest:
            held = holding_dir(self.path, self.model_digest, request.file)
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"part {request.file[:200]!r} of model "
                          f"{request.model_digest[:16]} is not held here")
        folder, part = held
        try:
            fd = open_part_file(folder, part.file, part.size)
        except PackageError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        try:
            label = f"{folder}: part {part.file}"
            for index in range(request.first_block, -(-part.size // BLOCK_SIZE)):
                start = index * BLOCK_SIZE
                data = bytearray(min(BLOCK_SIZE, part.size - start))
                read_at(fd, memoryview(data), start, label)
                digest = blake3(data).digest()
                self.served += len(data)
                yield pb.PartBlock(index=index, data=self._on_wire(part.file, index, data),
                                   blake3=digest)
        finally:
            os.close(fd)

    def _on_wire(self, file: str, index: int, data: bytearray) -> bytes:
        """The block as it leaves; tests damage it here, as a link might."""
        return bytes(data)


def serve_parts(servicer: PartsServicer, host: str,
                credentials: StageCredentials) -> tuple[grpc.Server, str]:
    """The parts service on host:<free port>, taking calls that carry the cluster token
    only, over TLS when the credentials hold certificates; returns it and its address."""
    rpc = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS),
                      interceptors=[SecretCheck(credentials.token)],
                      options=channel_options(MAX_MESSAGE), maximum_concurrent_rpcs=WORKERS)
    parts_pb2_grpc.add_PartsServicer_to_server(servicer, rpc)
    port = credentials.add_port(rpc, host)
    rpc.start()
    return rpc, f"{host}:{port}"


@ray.remote(num_cpus=0)
class PartServer:
    """The parts service on a node that holds them, for as long as the engine keeps it."""

    def __init__(self, path: str, model_digest: str, host: str | None, *,
                 credentials: StageCredentials):
        logging.basicConfig(level=logging.INFO)
        self._servicer = PartsServicer(path, model_digest)
        host = host or ray.util.get_node_ip_address()
        self._rpc, self._address = serve_parts(self._servicer, host, credentials)
        log.info("serving parts of model %s on %s", model_digest[:16], self._address)

    def address(self) -> str:
        return self._address

    def served(self) -> int:
        return self._servicer.served
