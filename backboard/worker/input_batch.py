"""Flat-batch input preparation.

`InputBatch` keeps every running request's state in persistent host arrays (token ids, block
table, state slots, sampling parameters), indexed by the request's row; `build_step` turns a step's
rows into token ids, positions and ForwardMeta with numpy (no per-token Python loops). Requests are
reordered so that uniform groups (decodes with one row, then verify groups with 1 + k rows) come
first and prefills last."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backboard.forward_context import ForwardMeta, UniformGroup


def group_order(q_lens: np.ndarray, is_spec: np.ndarray) -> np.ndarray:
    """Stable order: plain decodes (q = 1), then verify groups by row count, then prefills."""
    kind = np.where(is_spec, 1, np.where(q_lens == 1, 0, 2))
    sub = np.where(kind == 1, q_lens, 0)
    return np.lexsort((np.arange(len(q_lens)), sub, kind))


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T]
    meta: ForwardMeta
    query_start_loc: np.ndarray    # [B + 1], batch order
    positions_cpu: np.ndarray      # [T]


def build_step(input_ids: np.ndarray, q_lens: np.ndarray, num_computed: np.ndarray,
               block_table: np.ndarray, state_slots: np.ndarray, verify_dst_slots: list[np.ndarray | None] | None,
               block_size: int, device: torch.device | str = "cpu") -> StepInputs:
    """Requests already in group order (see group_order). input_ids [T]; q_lens, num_computed,
    state_slots [B]; block_table [B, M]; verify_dst_slots[i]: [L_i] verify destination slots or None
    (verify_dst_slots None: no verify rows)."""
    B = len(q_lens)
    if verify_dst_slots is None and B and q_lens.max() == 1:        # plain decode: the common step
        qsl = np.arange(B + 1, dtype=np.int64)
        positions = num_computed.astype(np.int64, copy=False)
        req_of_tok = np.arange(B)
        groups_spec: list[tuple[int, int, int, int, np.ndarray | None]] = [(0, B, 1, 0, None)]
        prefill_start = B
    else:
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        req_of_tok = np.repeat(np.arange(B), q_lens)
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[:-1][req_of_tok] + num_computed[req_of_tok]
        groups_spec, prefill_start = _uniform_groups(q_lens, qsl, verify_dst_slots)
    T = int(qsl[-1])
    seq_lens = num_computed + q_lens
    slot_mapping = (block_table[req_of_tok, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    groups = [UniformGroup(i, j, L, ts, None if dst is None else torch.from_numpy(dst).to(device))
              for i, j, L, ts, dst in groups_spec]
    has_init = num_computed > 0
    # one host-to-device transfer per dtype; the fields are views of it
    i64 = torch.from_numpy(np.concatenate([input_ids, positions, slot_mapping, state_slots])).to(device)
    i32 = torch.from_numpy(np.concatenate([block_table.ravel(), seq_lens]).astype(np.int32)).to(device)
    M = block_table.shape[1]
    meta = ForwardMeta(
        num_tokens=T, positions=i64[T:2 * T], slot_mapping=i64[2 * T:3 * T],
        block_table=i32[:B * M].view(B, M), seq_lens=i32[B * M:], seq_lens_cpu=seq_lens,
        query_start_loc_cpu=qsl, state_slots=i64[3 * T:], has_initial_state=torch.from_numpy(has_init).to(device),
        has_initial_state_cpu=has_init, groups=groups, prefill_start=prefill_start)
    return StepInputs(i64[:T], meta, qsl, positions)


def _uniform_groups(q_lens: np.ndarray, qsl: np.ndarray, verify_dst_slots: list[np.ndarray | None] | None):
    """Runs of equal (kind, rows) before the first prefill: [(req_start, req_end, L, tok_start,
    dst [n, L] or None)], and the first prefill request."""
    B = len(q_lens)
    is_spec = (np.fromiter((d is not None for d in verify_dst_slots), dtype=bool, count=B)
               if verify_dst_slots is not None else np.zeros(B, dtype=bool))
    kind = np.where(is_spec, 1, np.where(q_lens == 1, 0, 2))
    prefill_start = int(np.searchsorted(kind, 2))            # kinds are sorted (group_order)
    if prefill_start == 0:
        return [], 0
    key = (kind * (int(q_lens.max()) + 1) + q_lens)[:prefill_start]
    bounds = [0] + (np.flatnonzero(np.diff(key)) + 1).tolist() + [prefill_start]
    return [(i, j, int(q_lens[i]), int(qsl[i]), np.stack(verify_dst_slots[i:j]) if is_spec[i] else None)
            for i, j in zip(bounds[:-1], bounds[1:])], prefill_start


# ---- a list-of-requests front for tests and benchmarks ------------------------------------
@dataclass
class BatchRequest:
    """One request's share of a step."""

    token_ids: np.ndarray          # [q_len] the tokens to compute this step
    num_computed: int              # tokens already in the caches
    block_ids: list[int] | np.ndarray
    state_slot: int                # GDN slot holding the state after num_computed tokens
    spec_dst_slots: list[int] | None = None


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    meta: ForwardMeta
    order: np.ndarray              # batch row i holds caller request order[i]
    query_start_loc: np.ndarray


def prepare_batch(reqs: list[BatchRequest], block_size: int, device: torch.device | str = "cpu",
                  ) -> PreparedBatch:
    q_lens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
    is_spec = np.array([r.spec_dst_slots is not None for r in reqs])
    order = group_order(q_lens, is_spec)
    reqs = [reqs[i] for i in order]
    num_computed = np.array([r.num_computed for r in reqs], dtype=np.int64)
    need = -(-(num_computed + q_lens[order]) // block_size)
    have = np.array([len(r.block_ids) for r in reqs])
    if np.any(need > have):
        i = int(np.nonzero(need > have)[0][0])
        raise ValueError(f"request {order[i]} needs {need[i]} KV blocks but has {have[i]}")
    block_table = np.zeros((len(reqs), max(1, int(have.max(initial=1)))), dtype=np.int32)
    for i, r in enumerate(reqs):
        block_table[i, :len(r.block_ids)] = r.block_ids
    ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in reqs])
    spec = [np.asarray(r.spec_dst_slots, dtype=np.int64) if r.spec_dst_slots is not None else None
            for r in reqs] if is_spec.any() else None       # None: no verify rows, as the runner passes
    st = build_step(ids, q_lens[order], num_computed, block_table,
                    np.array([r.state_slot for r in reqs], dtype=np.int64), spec, block_size, device)
    return PreparedBatch(st.input_ids, st.meta, order, st.query_start_loc)


# ---- persistent per-request state of the model runner ------------------------------------
class InputBatch:
    """Host arrays indexed by row (one row per live request)."""

    def __init__(self, max_reqs: int, max_model_len: int, max_blocks: int, slots_per_req: int) -> None:
        self.max_reqs, self.max_model_len = max_reqs, max_model_len
        self.token_ids = np.zeros((max_reqs, max_model_len + 16), dtype=np.int64)
        self.num_tokens = np.zeros(max_reqs, dtype=np.int64)      # known tokens (no drafts)
        self.num_prompt = np.zeros(max_reqs, dtype=np.int64)
        # first position whose prompt logprob is still owed (earlier ones were emitted before a
        # preemption): positions p >= it emit the logprob of prompt token p + 1
        self.prompt_logprobs_from = np.zeros(max_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_reqs, dtype=np.int64)
        self.state_slots = np.zeros((max_reqs, slots_per_req), dtype=np.int64)
        self.cur_slot = np.zeros(max_reqs, dtype=np.int64)        # slot holding the current state
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def add(self, req_id: str, token_ids: list[int], num_prompt: int, block_ids: list[int],
            state_slots: list[int], prompt_logprobs_from: int = 0) -> int:
        if req_id in self.row_of:
            raise RuntimeError(f"{req_id} is already in the batch")
        if not self._free_rows:
            raise RuntimeError("input batch is full")
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row], self.num_prompt[row] = n, num_prompt
        self.prompt_logprobs_from[row] = prompt_logprobs_from
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        if state_slots:
            self.state_slots[row, :len(state_slots)] = state_slots
            self.cur_slot[row] = state_slots[0]
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        nb = int(self.num_blocks[row])
        self.block_table[row, nb:nb + len(block_ids)] = block_ids
        self.num_blocks[row] = nb + len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
