"""Flat-batch input preparation: per-request host arrays -> token ids, positions and ForwardMeta.

Vectorised with numpy (no per-token Python loops). Requests are reordered so that uniform groups
(decodes with one row, then verify groups with 1 + k rows) come first and prefills last; the
returned `order` maps batch rows back to the caller's request order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backboard.worker.attn_metadata import ForwardMeta, UniformGroup


@dataclass
class BatchRequest:
    """One request's share of a step, as the model runner sees it."""

    token_ids: np.ndarray          # [q_len] the tokens to compute this step
    num_computed: int              # tokens already in the caches (context before this step)
    block_ids: list[int] | np.ndarray
    state_slot: int                # GDN slot holding the state after num_computed tokens
    spec_dst_slots: list[int] | None = None   # verify: slot for the state after each row


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor        # [T]
    meta: ForwardMeta
    order: np.ndarray              # batch row i holds caller request order[i]
    query_start_loc: np.ndarray    # [B + 1] in batch order

    def last_token_rows(self) -> np.ndarray:
        """Flat row of each request's last token, in batch order."""
        return self.query_start_loc[1:] - 1


def _group_key(r: BatchRequest) -> tuple[int, int]:
    q = len(r.token_ids)
    if r.spec_dst_slots is not None:
        return (1, q)              # verify groups, by row count
    if q == 1:
        return (0, 1)              # plain decodes
    return (2, 0)                  # prefill spans


def prepare_batch(reqs: list[BatchRequest], block_size: int, device: torch.device | str = "cpu",
                  ) -> PreparedBatch:
    keys = [_group_key(r) for r in reqs]
    order = np.array(sorted(range(len(reqs)), key=lambda i: keys[i]), dtype=np.int64)
    reqs = [reqs[i] for i in order]
    keys = [keys[i] for i in order]
    B = len(reqs)
    q_lens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
    num_computed = np.array([r.num_computed for r in reqs], dtype=np.int64)
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    T = int(qsl[-1])
    seq_lens = num_computed + q_lens
    max_blocks = max(1, max(len(r.block_ids) for r in reqs))
    block_table = np.zeros((B, max_blocks), dtype=np.int32)
    for i, r in enumerate(reqs):
        block_table[i, :len(r.block_ids)] = r.block_ids
    # positions and KV slots of every token
    req_of_tok = np.repeat(np.arange(B), q_lens)
    positions = np.arange(T, dtype=np.int64) - qsl[:-1][req_of_tok] + num_computed[req_of_tok]
    needed = (seq_lens + block_size - 1) // block_size
    short = np.nonzero(needed > np.array([len(r.block_ids) for r in reqs]))[0]
    if len(short):
        i = int(short[0])
        raise ValueError(f"request in batch row {i} needs {needed[i]} KV blocks for {seq_lens[i]} tokens "
                         f"but has {len(reqs[i].block_ids)}")
    slot_mapping = (block_table[req_of_tok, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    input_ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in reqs]) if B else np.zeros(0, np.int64)
    # uniform groups
    groups: list[UniformGroup] = []
    i = 0
    while i < B and keys[i][0] in (0, 1):
        j = i
        while j < B and keys[j] == keys[i]:
            j += 1
        dst = None
        if keys[i][0] == 1:
            dst = torch.tensor([reqs[k].spec_dst_slots for k in range(i, j)], dtype=torch.int64,
                               device=device)
        groups.append(UniformGroup(i, j, int(q_lens[i]), int(qsl[i]), dst))
        i = j
    has_init = num_computed > 0
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)  # noqa: E731
    meta = ForwardMeta(
        num_tokens=T,
        positions=t(positions, torch.int64),
        slot_mapping=t(slot_mapping, torch.int64),
        block_table=t(block_table, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=qsl,
        state_slots=t(np.array([r.state_slot for r in reqs], dtype=np.int64), torch.int64),
        has_initial_state=t(has_init, torch.bool),
        has_initial_state_cpu=has_init,
        groups=groups,
        prefill_start=i,
    )
    return PreparedBatch(t(input_ids, torch.int64), meta, order, qsl)
