"""The two ZeroMQ sockets between the front end and an engine process, and where they live.

    input    front end ROUTER (binds)  ──►  engine DEALER (connects, routing id = engine identity)
    output   front end PULL (binds)    ◄──  engine PUSH (connects)

The front end binds and engines connect, so one front end can later serve several engines
(data parallel), on this machine (ipc://) or others (tcp://): the ROUTER addresses each engine by
its identity, the PULL fans their outputs in. Each engine announces itself with one empty frame
on its input socket (the ROUTER can only route to a peer it has seen).

High-water marks are 0 (unbounded): a send never blocks and never drops; bounding the work in
flight is the front end's business, not the transport's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq

ENGINE_IDENTITY = b"engine-0"
LINGER_MS = 5000          # how long closing a socket waits to deliver what is still queued


@dataclass(frozen=True)
class EngineAddresses:
    """Where the front end binds: `input` carries requests to the engine, `output` step outputs back."""

    input: str
    output: str
    tmp_dir: str | None = None              # an ipc directory made for these sockets (removed after)

    @classmethod
    def parse(cls, spec: str | None) -> "EngineAddresses":
        """None: ipc sockets in a fresh temp dir. `ipc://DIR`: DIR/input and DIR/output.
        `tcp://HOST:PORT`: PORT and PORT + 1 (PORT 0: any free ports)."""
        if spec is None:
            d = tempfile.mkdtemp(prefix="backboard-")
            return cls(f"ipc://{d}/input", f"ipc://{d}/output", tmp_dir=d)
        if spec.startswith("ipc://"):
            d = spec[len("ipc://"):].rstrip("/")
            os.makedirs(d, exist_ok=True)
            return cls(f"ipc://{d}/input", f"ipc://{d}/output")
        if spec.startswith("tcp://"):
            host, _, port = spec[len("tcp://"):].rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"engine address {spec!r}: expected tcp://HOST:PORT")
            p = int(port)
            return cls(f"tcp://{host}:{p or '*'}", f"tcp://{host}:{p + 1 if p else '*'}")
        raise ValueError(f"engine address {spec!r}: expected ipc://DIR or tcp://HOST:PORT")

    def cleanup(self) -> None:
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


def make_socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool,
                identity: bytes | None = None) -> zmq.Socket:
    """A socket of `kind` bound to (or connected to) `address`; unbounded queues."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)    # a peer that is gone raises, never drops
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def bound_address(sock: zmq.Socket) -> str:
    """The address a bound socket really listens on (a wildcard port resolved), to connect to."""
    addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return addr.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
