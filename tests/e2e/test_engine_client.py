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
from backboard.engine.request_stream import EngineDeadError, RequestDelta
from backboard.engine.tokenizer import Tokenizer
from backboard.request import EngineCoreRequest
from backboard.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


async def _started(model: str, addresses: str | None = None) -> AsyncLLM:
    cfg = EngineConfig.create(model, max_model_len=512, max_num_seqs=8, cpu_threads=1)
    engine = AsyncLLM(cfg, Tokenizer(model), log_level="warning", addresses=addresses)
    await engine.start()
    await asyncio.wait_for(engine.wait_ready(), 240)
    return engine


async def _deltas(stream) -> list[RequestDelta]:
    out = []
    async for deltas in stream:
        out += deltas
    return out


async def _tokens(stream) -> list[int]:
    return [t for d in await _deltas(stream) for c in d.outputs for t in c.token_ids]


async def _until_tokens(stream, n: int) -> None:
    got = 0
    while got < n:
        got += sum(len(c.token_ids) for d in await stream.get() for c in d.outputs)


@pytest.mark.parametrize("addresses", [None, "tcp://127.0.0.1:0"], ids=["ipc", "tcp"])
def test_request_deltas_over_either_transport(server_model, addresses):
    """n = 2 seeded completions with logprobs and prompt logprobs: each request's deltas add up to
    what the offline LLM returns, over ipc:// and tcp:// alike."""
    from backboard import LLM

    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=2,
                        prompt_logprobs=1)
    want = LLM(server_model, max_model_len=512).generate([[3, 4, 5]], sp)[0]

    async def main() -> list[list[RequestDelta]]:
        engine = await _started(server_model, addresses)
        try:
            streams = [engine.add_request([3, 4, 5], sp, f"r{i}") for i in range(2)]
            return await asyncio.wait_for(asyncio.gather(*map(_deltas, streams)), 120)
        finally:
            await engine.shutdown()

    for deltas in asyncio.run(main()):
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        last = deltas[-1]
        assert last.num_prompt_tokens == 3 and last.num_output_tokens == 12
        assert last.prompt_logprobs[0] is None and len(last.prompt_logprobs) == 3
        for got, exp in zip(last.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert got.keys() == exp.keys() and list(got.values()) == pytest.approx(list(exp.values()), abs=1e-5)
        assert all(d.prompt_logprobs is None for d in deltas[:-1])
        for i, c in enumerate(want.outputs):
            mine = [x for d in deltas for x in d.outputs if x.index == i]
            assert [t for x in mine for t in x.token_ids] == c.token_ids
            assert "".join(x.text for x in mine) == c.text
            assert [lp.logprob for x in mine for lp in x.logprobs] == pytest.approx(
                [d[t] for d, t in zip(c.logprobs, c.token_ids)], abs=1e-5)
            assert mine[-1].finish_reason == "length" and all(x.finish_reason is None for x in mine[:-1])


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


def test_fatal_engine_error_is_reported(server_model, caplog):
    """A request that breaks the engine loop (an out-of-vocabulary token sent past the front
    end's validation): the engine reports the error and exits; everything in flight fails. The
    error's text goes to the log, not to the clients."""
    async def main() -> None:
        engine = await _started(server_model)
        try:
            stream = engine.add_request([7, 8], LONG, "ok")
            await asyncio.wait_for(_until_tokens(stream, 1), 120)
            engine._send(M.AddRequests([EngineCoreRequest("bad", [10 ** 7], GREEDY)]))
            with pytest.raises(EngineDeadError, match="the engine failed") as failed:
                await asyncio.wait_for(_tokens(stream), 30)
            assert "Error" not in str(failed.value)
            assert any("the engine failed: IndexError" in r.getMessage() for r in caplog.records)
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
