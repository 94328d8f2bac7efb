"""The runner's bookkeeping for verify rows: where each verify row's GDN state lands, which slot is
current after acceptance, and the acceptance counts the scheduler reports.

A request verifying k drafts runs 1 + k rows; the state after row j is written to its own slot
dst[j] (the current slot first, then the request's other slots), so accepting j drafts makes dst[j]
the current slot: no state copy. (The rejection sampling itself is sample/rejection.py.)"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from backboard.core.state_pool import verify_slot_order
from backboard.worker.input_batch import InputBatch


def verify_dst_slots(batch: InputBatch, rows: np.ndarray, drafts: Sequence[Sequence[int]],
                     ) -> list[np.ndarray | None]:
    """[B]: for each request with drafts, the slot of the state after each of its 1 + k rows
    ([1 + k]); None for the others. rows [B] input-batch rows."""
    return [_dst(batch, int(r), len(d) + 1) if len(d) else None for r, d in zip(rows, drafts)]


def _dst(batch: InputBatch, row: int, L: int) -> np.ndarray:
    # the scheduler follows the same rule to know which slot holds a request's state; a model
    # without GDN layers has distinct slots for none of its rows (padded with slot 0, never read)
    dst = verify_slot_order(batch.state_slots[row].tolist(), int(batch.cur_slot[row]), L)
    return np.array(dst + [0] * (L - len(dst)), dtype=np.int64)


def commit_accepted_slots(batch: InputBatch, rows: np.ndarray, dst: Sequence[np.ndarray | None],
                          num_accepted: np.ndarray, sampled: Sequence[Sequence[int]]) -> None:
    """The state after the last accepted row becomes the current one ([B] each; requests that
    sampled nothing or had no drafts keep theirs)."""
    for i, d in enumerate(dst):
        if d is not None and sampled[i]:
            batch.cur_slot[rows[i]] = d[num_accepted[i]]


def acceptance_counts(drafts: Sequence[Sequence[int]], num_accepted: np.ndarray,
                      ) -> tuple[list[int], list[int], list[int]]:
    """(drafts per request [B], accepted per request [B], accepted at each draft position over all
    requests [k_max])."""
    lens = np.array([len(d) for d in drafts])
    per_position = [int(np.sum((num_accepted > j) & (lens > j))) for j in range(int(lens.max()))]
    return lens.tolist(), num_accepted.tolist(), per_position
