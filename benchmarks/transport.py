#!/usr/bin/env python
"""What one message across the process boundary costs, old transport vs new, at 256 requests:

    old   length-prefixed pickle frames over two OS pipes (the design before issue 10)
    new   msgspec/msgpack frames over ZeroMQ sockets (engine/messages.py, engine/transport.py;
          the engine side is the engine process's own EngineIO)

Messages (the shapes the engine sends and gets at 256 running requests):

    step          one StepOutputs: 256 EngineCoreOutputs of one decoded token each
    step+lp5      the same with 5 top logprobs per token
    add           one AddRequests of 256 requests with --prompt-len token prompts

Each is timed as a ping-pong between two processes (this one and a spawned "engine"): for step
outputs the front end asks and the engine encodes + sends, the front end receives + decodes;
for adds the front end encodes + sends, the engine receives + decodes and acks. The same ping-pong
with an empty message is the floor (the hop itself); payload = round trip - floor is what the
message costs (serialize + copy + deserialize). Both sides use blocking sockets here (the front
end's asyncio loop is left out of both). "codec" is encode + decode of the message in one
process, without any transport.

    python benchmarks/transport.py [--requests 256] [--prompt-len 1024] [--iters 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq  # noqa: E402

from backboard.core.outputs import EngineCoreOutput, TokenLogprobs  # noqa: E402
from backboard.engine import messages as M  # noqa: E402
from backboard.engine.core_proc import EngineIO  # noqa: E402
from backboard.engine.transport import ENGINE_IDENTITY, EngineAddresses, bound_address, make_socket  # noqa: E402
from backboard.request import EngineCoreRequest  # noqa: E402
from backboard.sampling_params import SamplingParams  # noqa: E402

_HEADER = 8
WARMUP = 5


# ---- the messages --------------------------------------------------------------------------------
def step_message(n: int, logprobs: int) -> M.StepOutputs:
    now = time.time()
    outs = []
    for i in range(n):
        lps = None
        if logprobs:
            lps = [TokenLogprobs(1000 + i, -0.5, 1, tuple((1000 + j, -0.5 - j) for j in range(logprobs)))]
        outs.append(EngineCoreOutput(f"cmpl-{i:032x}", [1000 + i], lps, None, None, None, 1024, now, now, now, 0))
    return M.StepOutputs(outs)


def add_message(n: int, prompt_len: int) -> M.AddRequests:
    sp = SamplingParams(max_tokens=1024, temperature=0.8, top_p=0.95, ignore_eos=True)
    return M.AddRequests([EngineCoreRequest(f"cmpl-{i:032x}", list(range(i, i + prompt_len)), sp, (2,),
                                            time.time()) for i in range(n)])


def empty_like(msg):
    return M.StepOutputs() if isinstance(msg, M.StepOutputs) else M.AddRequests([])


@dataclass
class OldStepMessage:
    """The old design's engine -> front end message (pickled as ("step", it))."""

    outputs: list = field(default_factory=list)
    received: dict = field(default_factory=dict)
    rejected: list = field(default_factory=list)
    stats: object = None


def old_form(msg):
    """What the old design put on the pipe for this message."""
    if isinstance(msg, M.StepOutputs):
        return ("step", OldStepMessage(msg.outputs))
    return [("add", msg.requests)]


# ---- old: pickle frames over pipes ---------------------------------------------------------------
def pipe_send(fd: int, obj) -> None:
    payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    view = memoryview(len(payload).to_bytes(_HEADER, "little") + payload)
    while view:
        view = view[os.write(fd, view):]


def pipe_recv(fd: int):
    n = int.from_bytes(_read(fd, _HEADER), "little")
    return pickle.loads(_read(fd, n))


def _read(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            raise EOFError
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def old_engine(inp, out, result, direction: str, msg, iters: int) -> None:
    rfd, wfd = inp.fileno(), out.fileno()
    ack = ("step", OldStepMessage())
    c0 = 0.0
    for i in range(iters + WARMUP):
        c0 = time.process_time() if i == WARMUP else c0
        pipe_recv(rfd)
        pipe_send(wfd, msg if direction == "out" else ack)
    result.send(time.process_time() - c0)


def time_old(msg, iters: int) -> tuple[float, float]:
    """(wall, CPU of both processes) seconds per round trip."""
    ctx = mp.get_context("spawn")
    in_r, in_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    res_r, res_w = ctx.Pipe(duplex=False)
    direction = "out" if isinstance(msg, M.StepOutputs) else "in"
    payload = old_form(msg)
    p = ctx.Process(target=old_engine, args=(in_r, out_w, res_w, direction, payload, iters))
    p.start()
    in_r.close()
    out_w.close()
    rfd, wfd = out_r.fileno(), in_w.fileno()
    go = [] if direction == "out" else payload
    return _ping_pong(lambda: pipe_send(wfd, go), lambda: pipe_recv(rfd), iters, p, res_r)


def _ping_pong(send, recv, iters: int, proc, result) -> tuple[float, float]:
    t0 = c0 = 0.0
    for i in range(iters + WARMUP):
        if i == WARMUP:
            t0, c0 = time.perf_counter(), time.process_time()
        send()
        recv()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cpu += result.recv()
    proc.join()
    return wall / iters, cpu / iters


# ---- new: msgspec frames over ZeroMQ -------------------------------------------------------------
def new_engine(addrs: EngineAddresses, result, direction: str, msg, iters: int) -> None:
    io = EngineIO(addrs)
    ack = M.StepOutputs()
    c0 = 0.0
    for i in range(iters + WARMUP):
        c0 = time.process_time() if i == WARMUP else c0
        io.recv(block=True)
        io.send(msg if direction == "out" else ack)
    result.send(time.process_time() - c0)
    io.close()


def time_new(msg, iters: int) -> tuple[float, float]:
    ctx = zmq.Context()
    a = EngineAddresses.parse(None)
    inp = make_socket(ctx, zmq.ROUTER, a.input, bind=True)
    out = make_socket(ctx, zmq.PULL, a.output, bind=True)
    addrs = EngineAddresses(bound_address(inp), bound_address(out))
    direction = "out" if isinstance(msg, M.StepOutputs) else "in"
    enc, dec = M.encoder(), M.output_decoder()
    sp = mp.get_context("spawn")
    res_r, res_w = sp.Pipe(duplex=False)
    p = sp.Process(target=new_engine, args=(addrs, res_w, direction, msg, iters))
    p.start()
    inp.recv_multipart()                        # the engine's hello
    go = [] if direction == "out" else [msg]
    out_ = _ping_pong(lambda: inp.send_multipart([ENGINE_IDENTITY, enc.encode(go)], copy=False),
                      lambda: dec.decode(out.recv(copy=False).buffer), iters, p, res_r)
    inp.close(0)
    out.close(0)
    ctx.term()
    a.cleanup()
    return out_


# ---- codecs alone --------------------------------------------------------------------------------
def time_codec(encode, decode, obj, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        decode(encode(obj))
    return (time.perf_counter() - t0) / iters


def codecs(msg, iters: int) -> tuple[float, float, int, int]:
    """(old s, new s, old bytes, new bytes) for encode + decode in one process."""
    enc = M.encoder()
    dec = M.output_decoder() if isinstance(msg, M.StepOutputs) else M.input_decoder()
    new_obj = msg if isinstance(msg, M.StepOutputs) else [msg]
    old_obj = old_form(msg)
    dumps = lambda o: pickle.dumps(o, pickle.HIGHEST_PROTOCOL)  # noqa: E731
    return (time_codec(dumps, pickle.loads, old_obj, iters), time_codec(enc.encode, dec.decode, new_obj, iters),
            len(dumps(old_obj)), len(enc.encode(new_obj)))


# ---- main ----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=200, help="round trips per step case (adds: a tenth)")
    args = ap.parse_args()
    n = args.requests
    cases = [("step", step_message(n, 0), args.iters), ("step+lp5", step_message(n, 5), args.iters),
             ("add", add_message(n, args.prompt_len), max(5, args.iters // 10))]
    floor_old, floor_new = time_old(M.StepOutputs(), args.iters), time_new(M.StepOutputs(), args.iters)
    print(f"{n} requests, prompts of {args.prompt_len} tokens. ms per message: the round trip minus the "
          "empty ping-pong (the floor),\nas wall time and as CPU time of both processes together. Floor: "
          f"old {_ms(floor_old[0])} wall / {_ms(floor_old[1])} CPU, new {_ms(floor_new[0])} / {_ms(floor_new[1])}")
    print(f"{'message':>9} | {'wall old':>8} {'new':>8} {'old/new':>7} | {'CPU old':>8} {'new':>8} {'old/new':>7} | "
          f"{'codec old':>9} {'new':>8} | {'KiB old':>7} {'new':>6}")
    for name, msg, iters in cases:
        old, new = time_old(msg, iters), time_new(msg, iters)
        wo, wn = old[0] - floor_old[0], new[0] - floor_new[0]
        co, cn = old[1] - floor_old[1], new[1] - floor_new[1]
        c_old, c_new, b_old, b_new = codecs(msg, iters)
        print(f"{name:>9} | {_ms(wo):>8} {_ms(wn):>8} {wo / max(wn, 1e-9):7.2f} | {_ms(co):>8} {_ms(cn):>8} "
              f"{co / max(cn, 1e-9):7.2f} | {_ms(c_old):>9} {_ms(c_new):>8} | {b_old / 1024:7.1f} {b_new / 1024:6.1f}",
              flush=True)
    print("old = pickle frames over OS pipes; new = msgspec over ZeroMQ ipc://; codec = encode + decode in "
          "one process, no transport")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


if __name__ == "__main__":
    main()
