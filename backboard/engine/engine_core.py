"""The engine loop: schedule -> execute -> update. Runs in-process for the offline LLM and in its
own process behind the HTTP server (engine/core_proc.py)."""

from __future__ import annotations

import logging
import time

from backboard.config import EngineConfig
from backboard.core.outputs import EngineCoreOutput, SchedulerStats
from backboard.core.scheduler import Scheduler
from backboard.engine.structured_output import StructuredOutputManager
from backboard.request import EngineCoreRequest, Request, RequestStatus

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05        # idle but for grammars compiling: how long one step waits for them


class EngineCore:
    def __init__(self, cfg: EngineConfig) -> None:
        from backboard.sample.grammar_mask import GrammarBatch
        from backboard.worker.model_runner import ModelRunner
        from backboard.worker.tp_executor import start_tp_workers

        self.cfg = cfg
        self.tp_workers = start_tp_workers(cfg)      # TP: ranks 1..N-1; this process is rank 0
        proposer = None
        if cfg.spec is not None:
            from backboard.spec_decode import build_proposer

            proposer = build_proposer(cfg)
        self.runner = ModelRunner(cfg, proposer)
        self.scheduler = Scheduler(cfg.scheduler, cfg.cache.block_size, self.runner.num_blocks,
                                   self.runner.num_slots if cfg.model.is_hybrid else None,
                                   cfg.num_spec_tokens, self._prefix_cache_settings(proposer))
        self.structured = StructuredOutputManager(cfg)
        self.runner.grammars = GrammarBatch(self.structured.compiler.get)
        self.num_steps = 0
        self.num_tokens_generated = 0
        self.num_prompt_tokens = 0
        # cumulative seconds of step(): in the scheduler (schedule + update), in the runner, and
        # the runner's forward pass (model + LM head)
        self.schedule_time_s = self.execute_time_s = self.forward_time_s = 0.0

    def _prefix_cache_settings(self, proposer):
        from backboard.worker.memory import prefix_cache_settings

        extra = proposer.num_extra_attn_layers if proposer is not None else 0
        return prefix_cache_settings(self.cfg, self.runner.dtype, extra)

    def add_request(self, ecr: EngineCoreRequest) -> None:
        """Raises ValueError when the request cannot be served (e.g. it can never fit). A request
        whose grammar is still compiling waits out of the scheduler until it is."""
        if not self.structured.hold(ecr):
            self.scheduler.add_request(Request(ecr, self.cfg.scheduler.max_model_len))
        self.num_prompt_tokens += len(ecr.prompt_token_ids)

    def abort_requests(self, req_ids) -> list[EngineCoreOutput]:
        self.structured.abort(req_ids)
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids) -> list[EngineCoreOutput]:
        """Finish requests the front end ended (a stop string matched)."""
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(len(self.structured))

    def has_work(self) -> bool:
        """Something to step: an unfinished request that is not paused, or one whose grammar is
        compiling (engine/core_proc.py blocks on its input otherwise)."""
        return self.scheduler.has_work() or bool(len(self.structured))

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        failed = self._admit_compiled()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        ro = self.runner.execute_model(so)
        t2 = time.perf_counter()
        outs = failed + self.scheduler.update_from_output(so, ro)
        self.schedule_time_s += t1 - t0 + time.perf_counter() - t2
        self.execute_time_s += t2 - t1
        self.forward_time_s += ro.forward_time_s
        self.num_steps += 1
        self.num_tokens_generated += sum(len(o.new_token_ids) for o in outs)
        if not self.scheduler.has_unfinished_requests():
            self.scheduler.check_integrity()      # idle: every block and slot must be back
        return outs

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is ready join the scheduler (if they are all there is, wait a
        moment for one rather than spin)."""
        if not len(self.structured):
            return []
        if not self.scheduler.has_unfinished_requests():
            self.structured.wait(GRAMMAR_WAIT_S)
        ready, failed = self.structured.take_ready()
        for ecr in ready:
            try:
                self.scheduler.add_request(Request(ecr, self.cfg.scheduler.max_model_len))
            except ValueError as e:
                logger.warning("request %s: %s", ecr.request_id, e)
                failed.append(EngineCoreOutput(ecr.request_id, [], finish_reason="abort"))
        return failed

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing with TP = 1)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    def phase_times(self) -> dict[str, float]:
        """Cumulative seconds of step() by phase: schedule, forward, draft (proposing), sample
        (the rest of the runner: inputs, sampling, bookkeeping)."""
        draft = self.scheduler.spec_stats.spec_draft_time_s
        return {"schedule": self.schedule_time_s, "forward": self.forward_time_s, "draft": draft,
                "sample": max(0.0, self.execute_time_s - self.forward_time_s - draft)}

    def info(self) -> dict:
        from backboard.engine.engine_info import engine_info

        return engine_info(self)

    def describe(self) -> str:
        from backboard.worker.memory import num_checkpoint_slots_for

        r, c = self.runner, self.cfg
        ck = num_checkpoint_slots_for(c)
        slots = (f"state slots: {r.num_slots} ({r.num_slots - ck} for running requests, "
                 f"{c.scheduler.max_num_seqs} x {1 + c.num_spec_tokens}; {ck} more for prefix-cache state "
                 "checkpoints)")
        pc = ("on" + (f", a state checkpoint every {c.cache.checkpoint_interval} prompt tokens"
                      if c.model.is_hybrid and c.cache.checkpoint_interval else "")
              if c.cache.enable_prefix_caching else "off")
        return (f"KV cache: {r.num_blocks} blocks x {c.cache.block_size} tokens = "
                f"{r.num_blocks * c.cache.block_size} tokens; " + (slots + "; " if c.model.is_hybrid else "")
                + f"prefix caching {pc}; max_model_len {c.scheduler.max_model_len}; device {c.device}; "
                f"dtype {c.model.dtype}")
