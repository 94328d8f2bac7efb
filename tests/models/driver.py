"""A minimal driver of the model over flat batches, for parity tests: per-request block lists
and state slots handed out sequentially; each step is a list of (request id, token ids)."""

from __future__ import annotations

import numpy as np
import torch

from backboard.config import ModelConfig
from backboard.forward_context import set_forward_context
from backboard.models.loader import load_model, torch_dtype
from backboard.worker.input_batch import BatchRequest, prepare_batch
from backboard.worker.memory import allocate_caches


class FlatBatchDriver:
    def __init__(self, path: str, dtype: str = "float32", block_size: int = 16,
                 num_blocks: int = 256, num_slots: int = 16) -> None:
        self.cfg = ModelConfig.from_pretrained(path, dtype=dtype)
        self.model = load_model(self.cfg)
        self.block_size = block_size
        self.caches = allocate_caches(self.cfg, num_blocks, block_size, num_slots,
                                      torch_dtype(self.cfg.dtype))
        # hand out blocks in a scrambled order so that block tables are not the identity
        self.free_blocks = list(np.random.default_rng(0).permutation(num_blocks))
        self.free_slots = list(range(num_slots))[::-1]
        self.reqs: dict[int, dict] = {}

    def _req(self, rid: int) -> dict:
        if rid not in self.reqs:
            self.reqs[rid] = {"blocks": [], "computed": 0, "slot": self.free_slots.pop()}
        return self.reqs[rid]

    @torch.no_grad()
    def step(self, work: list[tuple[int, list[int]]], all_logits: bool = False):
        """work: [(request id, token ids to compute)]. Returns {rid: logits} of each request's
        last token ([V]) or, with all_logits, of all its tokens ([q, V])."""
        batch = []
        for rid, toks in work:
            r = self._req(rid)
            need = -(-(r["computed"] + len(toks)) // self.block_size)
            while len(r["blocks"]) < need:
                r["blocks"].append(int(self.free_blocks.pop()))
            batch.append(BatchRequest(np.asarray(toks), r["computed"], list(r["blocks"]), r["slot"]))
        pb = prepare_batch(batch, self.block_size)
        with set_forward_context(pb.meta, self.caches):
            hidden = self.model(pb.input_ids, pb.meta.positions)
        out = {}
        qsl = pb.query_start_loc
        for row, i in enumerate(pb.order):
            rid, toks = work[i]
            rows = torch.arange(qsl[row], qsl[row + 1]) if all_logits else torch.tensor([qsl[row + 1] - 1])
            logits = self.model.compute_logits(hidden[rows])
            out[rid] = logits if all_logits else logits[0]
            self.reqs[rid]["computed"] += len(toks)
        return out
