"""Grammar masks on logits: bit t of bitmask[r] (int32 words, little-endian bits) allows token t;
every other token's logit becomes -inf.

On CUDA xgrammar's kernel does it. On the CPU, a grammar's mask is nearly always either almost
empty (between JSON punctuation: a handful of tokens allowed) or almost full (inside a string), and
a per-element pass is slow for both at a 248K vocabulary; so rows with few allowed tokens keep
those logits, fill the row with -inf and put them back (a memset and two gathers), and the others
go to xgrammar's CPU pass, which skips all-ones words."""

from __future__ import annotations

import torch

_SPARSE_WORDS = 16        # a row with at most W / 16 nonzero words takes the sparse path
_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [R, V] in place; bitmask [R, W] int32; rows: the rows to mask."""
    if not rows:
        return
    idx = torch.tensor(rows, dtype=torch.long)
    bits = (bitmask[idx].cpu().unsqueeze(-1) >> _SHIFTS) & 1               # [n, W, 32]
    allowed = bits.reshape(len(rows), -1)[:, :logits.shape[1]].bool().to(logits.device)
    sub = logits[idx.to(logits.device)]
    logits[idx.to(logits.device)] = sub.masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Same contract as apply_token_bitmask_ref."""
    if not rows:
        return
    if logits.device.type == "cuda":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             indices=rows)
        return
    idx = torch.tensor(rows, dtype=torch.long)
    nonzero = (bitmask[idx] != 0).sum(1)                                   # [n] words with a bit set
    sparse = nonzero <= bitmask.shape[1] // _SPARSE_WORDS
    if bool(sparse.any()):
        _apply_sparse(logits, bitmask, idx[sparse])
    dense = idx[~sparse].tolist()
    if dense:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=dense, backend="cpu")


def _apply_sparse(logits: torch.Tensor, bitmask: torch.Tensor, idx: torch.Tensor) -> None:
    """Rows with few allowed tokens: keep those logits, fill with -inf, put them back."""
    words = bitmask[idx]                                                    # [n, W]
    r, w = (words != 0).nonzero(as_tuple=True)
    bits = ((words[r, w].unsqueeze(-1) >> _SHIFTS) & 1).bool()              # [N, 32]
    n, b = bits.nonzero(as_tuple=True)
    token = w[n] * 32 + b
    keep = token < logits.shape[1]
    row, token = idx[r[n]][keep], token[keep]
    vals = logits[row, token]
    logits.index_fill_(0, idx, float("-inf"))
    logits[row, token] = vals
