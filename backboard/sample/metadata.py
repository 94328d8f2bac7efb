"""What the sampler and the rejection sampler read per logit row, built by the runner each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class SpecDecodeMetadata:
    """Where each request's drafts sit among a step's R logit rows (B requests in batch order).

    Request i owns logit rows logit_start[i] .. logit_start[i] + len(drafts[i]): row j < k judges
    draft j, the last row gives the bonus token. Requests without drafts own one row."""

    drafts: Sequence[Sequence[int]]   # [B] drafts judged this step (empty: none)
    logit_start: np.ndarray           # [B] first logit row of each request
    req_of: np.ndarray                # [R] request of each logit row
