"""Numbers that several layers must agree on. No imports: any module, from core/ to server/, may
use these."""

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this samples greedily (argmax): SamplingParams.greedy, the runner's
all-greedy fast path and the sampler's per-row choice all test `temperature < GREEDY_TEMPERATURE`."""


def spec_token_margin(num_spec_tokens: int) -> int:
    """Positions past max_model_len that a sequence may reach when speculating k tokens: 1 + k
    verify rows (the newest token and its k drafts) and k more the proposer writes its own KV cache
    ahead to (the scheduler's lookahead blocks). Block tables, position buffers and the KV budget
    are sized for max_model_len + this (2k + 1)."""
    return 2 * num_spec_tokens + 1
