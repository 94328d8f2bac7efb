"""The process boundary without HTTP: AsyncLLM against a real engine process (tiny hybrid).
Outputs arrive over ipc:// and tcp:// alike; the engine's death (killed, or a fatal error in its
loop) fails every request in flight with EngineDeadError and refuses new ones; nothing hangs; an
engine whose front end is killed exits by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from backboard.config import EngineConfig
from backboard.engine import messages as M
from backboard.engine.async_llm import AsyncLLM
from backboard.engine.request_stream import EngineDeadError
from backboard.engine.tokenizer import Tokenizer
from backboard.request import EngineCoreRequest
from backboard.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


async def _started(model: str, addresses: str | None = None) -> AsyncLLM:
    cfg = EngineConfig.create(model, max_model_len=512, max_num_seqs=8)
    engine = AsyncLLM(cfg, Tokenizer(model), log_level="warning", addresses=addresses, cpu_threads=1)
    await engine.start()
    await asyncio.wait_for(engine.wait_ready(), 240)
    return engine


async def _tokens(stream) -> list[int]:
    out = []
    async for deltas in stream:
        for d in deltas:
            out += d.token_ids
    return out


async def _until_tokens(stream, n: int) -> None:
    got = 0
    while got < n:
        got += sum(len(d.token_ids) for d in await stream.get())


@pytest.mark.parametrize("addresses", [None, "tcp://127.0.0.1:0"], ids=["ipc", "tcp"])
def test_outputs_over_either_transport(server_model, addresses):
    from backboard import LLM

    want = LLM(server_model, max_model_len=512).generate([[3, 4, 5]], GREEDY)[0].outputs[0].token_ids

    async def main() -> list[list[int]]:
        engine = await _started(server_model, addresses)
        try:
            streams = [engine.add_request([3, 4, 5], GREEDY, f"r{i}") for i in range(3)]
            return await asyncio.wait_for(asyncio.gather(*map(_tokens, streams)), 120)
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == [want] * 3


def test_killed_engine_fails_requests_in_flight(server_model):
    async def main() -> None:
        engine = await _started(server_model)
        try:
            streams = [engine.add_request([7, 8], LONG, f"r{i}") for i in range(2)]
            await asyncio.wait_for(_until_tokens(streams[0], 2), 120)
            os.kill(engine.pid, signal.SIGKILL)
            for s in streams:
                with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                    await asyncio.wait_for(_tokens(s), 30)
            assert engine.state == "dead" and engine.num_unfinished == 0
            with pytest.raises(EngineDeadError):
                engine.add_request([1], GREEDY, "late")
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_fatal_engine_error_is_reported(server_model):
    """A request that breaks the engine loop (an out-of-vocabulary token sent past the front
    end's validation): the engine reports the error and exits; everything in flight fails with it."""
    async def main() -> None:
        engine = await _started(server_model)
        try:
            stream = engine.add_request([7, 8], LONG, "ok")
            await asyncio.wait_for(_until_tokens(stream, 1), 120)
            engine._send(M.AddRequests([EngineCoreRequest("bad", [10 ** 7], GREEDY)]))
            with pytest.raises(EngineDeadError, match="the engine failed: .*Error"):
                await asyncio.wait_for(_tokens(stream), 30)
            with pytest.raises(EngineDeadError, match="the engine failed"):
                engine.add_request([1], GREEDY, "late")
            await asyncio.get_running_loop().run_in_executor(None, engine._proc.join, 30)
            assert engine._proc.exitcode == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_engine_exits_when_front_end_is_killed(server_factory):
    server = server_factory()
    pid = server.engine_pid()
    server.proc.kill()
    server.proc.wait(30)
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine outlived its front end"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"     # a zombie has exited
    except FileNotFoundError:
        return False
