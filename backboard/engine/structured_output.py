"""Constrained requests in the engine core: their grammars compile on the compiler's thread while
they wait here, out of the scheduler, so the step loop never waits for a compile and never sees a
request its runner could not constrain. Compiled (most often at once: the cache) -> the scheduler;
failed -> finished as aborted, with the reason logged (the server checks specs before sending, so
this is rare)."""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

from backboard.config import EngineConfig
from backboard.core.outputs import EngineCoreOutput
from backboard.request import EngineCoreRequest

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, cfg: EngineConfig) -> None:
        from backboard.sample.grammar import GrammarCompiler

        mc = cfg.model
        self.compiler = GrammarCompiler(cfg.tokenizer or mc.path, mc.vocab_size, mc.eos_token_ids)
        self.waiting: dict[str, tuple[Future, EngineCoreRequest]] = {}

    def hold(self, ecr: EngineCoreRequest) -> bool:
        """True when the request waits here for its grammar (False: unconstrained or compiled)."""
        so = ecr.sampling_params.structured_outputs
        if so is None:
            return False
        fut = self.compiler.submit(so)
        if fut.done() and fut.exception() is None:
            return False
        self.waiting[ecr.request_id] = (fut, ecr)
        return True

    def take_ready(self) -> tuple[list[EngineCoreRequest], list[EngineCoreOutput]]:
        """(requests whose grammar compiled, outputs finishing those whose grammar failed)."""
        ready, failed = [], []
        for rid, (fut, ecr) in list(self.waiting.items()):
            if not fut.done():
                continue
            del self.waiting[rid]
            if fut.exception() is None:
                ready.append(ecr)
            else:
                logger.warning("request %s: %s", rid, fut.exception())
                failed.append(EngineCoreOutput(rid, [], finish_reason="abort",
                                               num_prompt_tokens=len(ecr.prompt_token_ids),
                                               arrival_time=ecr.arrival_time))
        return ready, failed

    def abort(self, req_ids) -> list[str]:
        """Drop waiting requests; returns the ids that were here."""
        return [rid for rid in req_ids if self.waiting.pop(rid, None) is not None]

    def wait(self, timeout: float) -> None:
        """Block until a grammar is done (or timeout): the engine has nothing else to do."""
        if self.waiting:
            wait([f for f, _ in self.waiting.values()], timeout, return_when=FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self.waiting)

    def shutdown(self) -> None:
        self.compiler.shutdown()
