"""What the sampler and the rejection sampler read, per logit row: the per-row parameter table the
runner keeps for its live requests (SamplingParamsTable), each step's SamplingMetadata gathered
from it (build_sampling_metadata), and where the drafts sit among the logit rows
(SpecDecodeMetadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from backboard.constants import GREEDY_TEMPERATURE
from backboard.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per logit row (R rows)."""

    temperature: torch.Tensor                       # [R] fp32; < GREEDY_TEMPERATURE means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None               # [R] int64, 0 = off
    top_p: torch.Tensor | None = None               # [R] fp32
    min_p: torch.Tensor | None = None               # [R] fp32
    # penalties (None when no row uses them)
    repetition: torch.Tensor | None = None          # [R]
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None         # [R, V] bool
    output_counts: torch.Tensor | None = None       # [R, V] fp32
    seeds: list[tuple[int, int, int]] | None = None  # (row, seed, position)
    min_tokens_mask: list[tuple[int, list[int]]] | None = None  # (row, token ids to forbid)
    num_logprobs: list[int] | None = None           # [R] top-n per row, -1 = none


@dataclass
class SpecDecodeMetadata:
    """Where each request's drafts sit among a step's R logit rows (B requests in batch order).

    Request i owns logit rows logit_start[i] .. logit_start[i] + len(drafts[i]): row j < k judges
    draft j, the last row gives the bonus token. Requests without drafts own one row."""

    drafts: Sequence[Sequence[int]]   # [B] drafts judged this step (empty: none)
    logit_start: np.ndarray           # [B] first logit row of each request
    req_of: np.ndarray                # [R] request of each logit row


class SamplingParamsTable:
    """Per-row sampling parameters as arrays ([max_reqs] each, indexed by input-batch row), so a
    step gathers them with one fancy index."""

    FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency",
              "seed", "logprobs", "prompt_logprobs", "min_tokens", "max_tokens")

    def __init__(self, max_reqs: int) -> None:
        self.a = {f: np.zeros(max_reqs, dtype=np.float64) for f in self.FIELDS}
        self.eos: list[list[int]] = [[] for _ in range(max_reqs)]
        # rows that need nothing but an argmax (greedy; no penalties, min_tokens or logprobs)
        self.plain_greedy = np.zeros(max_reqs, dtype=bool)

    def set(self, row: int, sp: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        a = self.a
        a["temperature"][row] = sp.temperature
        a["top_k"][row] = sp.top_k
        a["top_p"][row] = sp.top_p
        a["min_p"][row] = sp.min_p
        a["repetition"][row] = sp.repetition_penalty
        a["presence"][row] = sp.presence_penalty
        a["frequency"][row] = sp.frequency_penalty
        a["seed"][row] = -1 if sp.seed is None else sp.seed
        a["logprobs"][row] = -1 if sp.logprobs is None else sp.logprobs
        a["prompt_logprobs"][row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        a["min_tokens"][row] = sp.min_tokens
        a["max_tokens"][row] = sp.max_tokens if sp.max_tokens is not None else 1 << 40
        self.eos[row] = sorted(set(eos_token_ids) | set(sp.stop_token_ids or ()))
        self.plain_greedy[row] = (sp.greedy and not sp.needs_penalties and sp.min_tokens == 0
                                  and sp.logprobs is None)


class TokenHistory(Protocol):
    """The tokens penalties and min_tokens read (the runner's InputBatch), by input-batch row."""

    token_ids: np.ndarray             # [max_reqs, max_len] prompt, then outputs
    num_prompt: np.ndarray            # [max_reqs]


def build_sampling_metadata(table: SamplingParamsTable, brow: np.ndarray, choose_pos: np.ndarray,
                            history: TokenHistory, vocab_size: int, device: torch.device | str,
                            ) -> SamplingMetadata:
    """Metadata for R logit rows: brow [R] the input-batch row of each, choose_pos [R] the sequence
    position of the token it chooses (seeds, penalties and min_tokens depend on it)."""
    a = table.a
    temp = a["temperature"][brow]
    md = SamplingMetadata(temperature=torch.tensor(temp, dtype=torch.float32, device=device),
                          all_greedy=bool(np.all(temp < GREEDY_TEMPERATURE)))
    if not md.all_greedy:
        _random_params(md, a, brow, choose_pos, device)
    if np.any((a["repetition"][brow] != 1) | (a["presence"][brow] != 0) | (a["frequency"][brow] != 0)):
        _penalties(md, a, brow, choose_pos, history, vocab_size, device)
    n_out = choose_pos - history.num_prompt[brow]      # outputs before this token
    need_min = np.nonzero(n_out < a["min_tokens"][brow])[0]
    if len(need_min):
        md.min_tokens_mask = [(int(i), table.eos[brow[i]]) for i in need_min if table.eos[brow[i]]]
    md.num_logprobs = a["logprobs"][brow].astype(np.int64).tolist()
    return md


def _random_params(md: SamplingMetadata, a: dict[str, np.ndarray], brow: np.ndarray, choose_pos: np.ndarray,
                   device: torch.device | str) -> None:
    """top-k, top-p, min-p where any row uses them; the (row, seed, position) of seeded rows."""
    if np.any(a["top_k"][brow] > 0):
        md.top_k = torch.tensor(a["top_k"][brow], dtype=torch.int64, device=device)
    if np.any(a["top_p"][brow] < 1.0):
        md.top_p = torch.tensor(a["top_p"][brow], dtype=torch.float32, device=device)
    if np.any(a["min_p"][brow] > 0.0):
        md.min_p = torch.tensor(a["min_p"][brow], dtype=torch.float32, device=device)
    seeded = np.nonzero((a["seed"][brow] >= 0) & (a["temperature"][brow] >= GREEDY_TEMPERATURE))[0]
    md.seeds = [(int(i), int(a["seed"][brow[i]]), int(choose_pos[i])) for i in seeded]


def _penalties(md: SamplingMetadata, a: dict[str, np.ndarray], brow: np.ndarray, choose_pos: np.ndarray,
               history: TokenHistory, vocab_size: int, device: torch.device | str) -> None:
    """The prompt-token mask [R, V] and output-token counts [R, V] (outputs before choose_pos)."""
    R = len(brow)
    prompt_mask = torch.zeros(R, vocab_size, dtype=torch.bool)
    counts = torch.zeros(R, vocab_size, dtype=torch.float32)
    for i in range(R):
        r, npr, end = brow[i], history.num_prompt[brow[i]], choose_pos[i]
        prompt_mask[i, torch.from_numpy(history.token_ids[r, :npr])] = True
        out = torch.from_numpy(history.token_ids[r, npr:end])
        counts[i].index_add_(0, out, torch.ones(len(out)))
    md.prompt_mask, md.output_counts = prompt_mask.to(device), counts.to(device)
    md.repetition = torch.tensor(a["repetition"][brow], dtype=torch.float32, device=device)
    md.presence = torch.tensor(a["presence"][brow], dtype=torch.float32, device=device)
    md.frequency = torch.tensor(a["frequency"][brow], dtype=torch.float32, device=device)
