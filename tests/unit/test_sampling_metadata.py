"""The per-row parameter table and the metadata a step gathers from it (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from backboard.sample.metadata import SamplingParamsTable, build_sampling_metadata
from backboard.sampling_params import SamplingParams

V = 10


def _history():
    """Row 0: prompt [1, 2, 2], outputs [3, 3, 5]; row 1: prompt [4], outputs [6]."""
    token_ids = np.zeros((2, 8), dtype=np.int64)
    token_ids[0, :6] = [1, 2, 2, 3, 3, 5]
    token_ids[1, :2] = [4, 6]
    return SimpleNamespace(token_ids=token_ids, num_prompt=np.array([3, 1]))


def test_penalties_seeds_and_min_tokens_per_logit_row():
    table = SamplingParamsTable(2)
    table.set(0, SamplingParams(temperature=0.7, top_k=5, seed=11, repetition_penalty=1.3, frequency_penalty=0.5,
                                min_tokens=5, logprobs=2), eos_token_ids=(9,))
    table.set(1, SamplingParams(temperature=0.0), eos_token_ids=(9,))
    # three logit rows: row 0 chooses positions 5 and 6 (a verify pair), row 1 chooses position 2
    brow, choose_pos = np.array([0, 0, 1]), np.array([5, 6, 2])
    md = build_sampling_metadata(table, brow, choose_pos, _history(), V, "cpu")
    assert not md.all_greedy and md.temperature.tolist()[2] == 0.0
    assert md.top_k.tolist() == [5, 5, 0] and md.top_p is None and md.min_p is None
    assert md.seeds == [(0, 11, 5), (1, 11, 6)]                  # greedy rows are never seeded
    # the prompt mask holds the prompt tokens; the counts the outputs before each chosen position
    assert md.prompt_mask[0].nonzero().flatten().tolist() == [1, 2]
    assert md.prompt_mask[2].nonzero().flatten().tolist() == [4]
    assert md.output_counts[0, 3] == 2 and md.output_counts[0, 5] == 0     # position 5 is not yet known
    assert md.output_counts[1, 5] == 1 and md.output_counts[2, 6] == 1
    assert np.allclose(md.repetition.tolist(), [1.3, 1.3, 1.0])
    # min_tokens = 5: rows with fewer than 5 outputs before them forbid the stop tokens
    assert md.min_tokens_mask == [(0, [9]), (1, [9])]
    assert md.num_logprobs == [2, 2, -1]


def test_all_greedy_needs_no_random_parameters():
    table = SamplingParamsTable(2)
    table.set(0, SamplingParams(temperature=0.0, top_k=3, seed=1), eos_token_ids=())
    md = build_sampling_metadata(table, np.array([0]), np.array([4]), _history(), V, "cpu")
    assert md.all_greedy and md.top_k is None and md.seeds is None and md.prompt_mask is None
    assert table.plain_greedy[0]
