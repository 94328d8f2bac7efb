"""What crosses the process boundary between the front end (engine/async_llm.py) and the engine
process (engine/core_proc.py), and its encoding: msgspec structs, msgpack on the wire.

    front end -> engine   input socket    one frame per front-end loop turn: list[InputMessage],
                                          applied in order (AddRequests | AbortRequests |
                                          StopRequests | Shutdown)
    engine -> front end   output socket   one frame per message: OutputMessage (EngineReady |
                                          EngineStartFailed | EngineFailed, or one StepOutputs
                                          per engine step)

The payload types are the engine core's own (EngineCoreRequest, EngineCoreOutput, SchedulerStats:
dataclasses, which msgspec encodes and decodes natively); the structs here only frame them.
Messages are array-like (positional) and tagged by a short string, so a frame is small and
decoding needs no field names. The decoders are typed: a malformed frame raises
msgspec.ValidationError instead of producing a half-built object.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from backboard.core.outputs import EngineCoreOutput, SchedulerStats
from backboard.request import EngineCoreRequest


# ---- front end -> engine ------------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Free these requests; the front end already forgot them (no output is expected)."""

    request_ids: list[str]


class StopRequests(msgspec.Struct, tag="stop", array_like=True):
    """Finish these requests as stopped (a stop string matched in the front end)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Leave the loop and exit (whatever is still running is abandoned)."""


InputMessage = Union[AddRequests, AbortRequests, StopRequests, Shutdown]


# ---- engine -> front end ------------------------------------------------------------------------
class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    description: str                        # one line: cache sizes, device, dtype
    info: dict[str, Any] = {}               # the engine's configuration and build (engine_info.py)


class EngineStartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    """The model could not be loaded (bad checkpoint, bad setting); the process then exits."""

    kind: str                               # the exception's class name
    message: str


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine loop raised; the process exits right after sending this."""

    message: str


class EngineStats(msgspec.Struct, array_like=True):
    """Engine-side counters, sent with step outputs (at most every STATS_INTERVAL_S while busy,
    and whenever the engine goes idle)."""

    scheduler: SchedulerStats
    num_steps: int = 0
    step_time_s: float = 0.0          # cumulative wall time spent inside EngineCore.step()
    uptime_s: float = 0.0             # since the loop started
    time: float = 0.0                 # time.time() when taken
    num_generation_tokens: int = 0    # cumulative tokens sampled
    phase_time_s: dict[str, float] = {}  # cumulative step time per phase (EngineCore.phase_times())


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    """Everything one engine-loop iteration has for the front end."""

    outputs: list[EngineCoreOutput] = []
    received: dict[str, float] = {}             # request id -> time.time() the engine took it
    rejected: list[tuple[str, str]] = []        # (request id, why add_request refused it)
    stats: EngineStats | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.outputs or self.received or self.rejected or self.stats is not None)


OutputMessage = Union[EngineReady, EngineStartFailed, EngineFailed, StepOutputs]


# ---- the codec ----------------------------------------------------------------------------------
def encoder() -> msgspec.msgpack.Encoder:
    """Any message, or a list of them, -> one msgpack frame (`.encode(msg) -> bytes`)."""
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    """Frames from the front end: list[InputMessage]."""
    return msgspec.msgpack.Decoder(list[InputMessage])


def output_decoder() -> msgspec.msgpack.Decoder:
    """Frames from the engine: one OutputMessage each."""
    return msgspec.msgpack.Decoder(OutputMessage)
