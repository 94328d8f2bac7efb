"""The messages that cross the process boundary survive the wire (msgspec / msgpack) unchanged,
in order, with their types; a malformed frame is an error, not a half-built object; the engine
addresses parse as documented."""

from __future__ import annotations

import msgspec
import pytest

from backboard.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from backboard.engine import messages as M
from backboard.engine.transport import EngineAddresses
from backboard.request import EngineCoreRequest
from backboard.sampling_params import SamplingParams


def _request(i: int) -> EngineCoreRequest:
    sp = SamplingParams(n=1, temperature=0.7, top_p=0.9, seed=i, max_tokens=12, stop=["\n\n", "END"],
                        stop_token_ids=[7], logprobs=3, prompt_logprobs=1, extra={"k": [1, "v"]})
    return EngineCoreRequest(f"req-{i}", [1, 2, 3, 40000 + i], sp, (2, 151645), 1700000000.25 + i, i - 1)


def _output(i: int) -> EngineCoreOutput:
    lp = TokenLogprobs(5, -0.25, 1, ((5, -0.25), (9, -1.5)))
    return EngineCoreOutput(f"req-{i}", [5, 6], [lp, lp], [None, lp], "stop" if i else None,
                            "END" if i == 1 else (7 if i == 2 else None), 4, 1.5, 2.5, 3.5, i)


def test_inputs_round_trip_in_order():
    msgs = [M.AddRequests([_request(0), _request(1)]), M.StopRequests(["req-0"]),
            M.AbortRequests(["req-1", "req-9"]), M.AddRequests([_request(2)]), M.Shutdown()]
    got = M.input_decoder().decode(M.encoder().encode(msgs))
    assert got == msgs
    assert [type(m) for m in got] == [type(m) for m in msgs]
    r = got[0].requests[1]
    assert isinstance(r.sampling_params, SamplingParams) and r.sampling_params.stop == ["\n\n", "END"]
    assert r.eos_token_ids == (2, 151645) and r.priority == 0 and r.arrival_time == 1700000001.25


def test_outputs_round_trip():
    stats = M.EngineStats(SchedulerStats(num_running=3, kv_cache_usage=0.5, spec_accepted_per_position=[4, 2]),
                          num_steps=10, step_time_s=1.5, uptime_s=9.0, time=1700000000.0)
    step = M.StepOutputs([_output(0), _output(1), _output(2)], {"req-0": 1.0}, [("req-3", "too long")], stats)
    msgs = [M.EngineReady("KV cache: 8 blocks"), M.EngineStartFailed("CheckpointError", "missing x"),
            M.EngineFailed("IndexError: out of range"), step, M.StepOutputs()]
    enc, dec = M.encoder(), M.output_decoder()
    got = [dec.decode(enc.encode(m)) for m in msgs]
    assert got == msgs
    out = got[3].outputs[2]
    assert isinstance(out, EngineCoreOutput) and isinstance(out.new_logprobs[0], TokenLogprobs)
    assert out.new_prompt_logprobs[0] is None and out.new_logprobs[1].top == ((5, -0.25), (9, -1.5))
    assert out.stop_reason == 7 and got[3].outputs[1].stop_reason == "END"
    assert got[3].rejected == [("req-3", "too long")] and got[4].is_empty and not got[3].is_empty


def test_malformed_frames_are_errors():
    with pytest.raises(msgspec.ValidationError):
        M.output_decoder().decode(msgspec.msgpack.encode(["step", "not a list"]))
    with pytest.raises(msgspec.ValidationError):
        M.input_decoder().decode(msgspec.msgpack.encode([["launch", []]]))
    with pytest.raises(msgspec.DecodeError):
        M.input_decoder().decode(b"\xc1garbage")
    with pytest.raises(ValueError, match="top_p"):      # the engine re-validates what it is sent
        bad = msgspec.msgpack.encode([M.AddRequests([_request(0)])]).replace(
            msgspec.msgpack.encode(0.9), msgspec.msgpack.encode(2.0))
        M.input_decoder().decode(bad)


def test_engine_addresses():
    a = EngineAddresses.parse(None)
    try:
        assert a.input.startswith("ipc://") and a.output.startswith("ipc://") and a.input != a.output
        assert a.tmp_dir and a.input.startswith(f"ipc://{a.tmp_dir}/")
    finally:
        a.cleanup()
    t = EngineAddresses.parse("tcp://10.0.0.5:5555")
    assert (t.input, t.output, t.tmp_dir) == ("tcp://10.0.0.5:5555", "tcp://10.0.0.5:5556", None)
    assert EngineAddresses.parse("tcp://127.0.0.1:0").input == "tcp://127.0.0.1:*"
    for bad in ("udp://x:1", "tcp://nohost", "tcp://h:port"):
        with pytest.raises(ValueError, match="engine address"):
            EngineAddresses.parse(bad)
