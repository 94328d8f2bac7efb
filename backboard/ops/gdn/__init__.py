"""Gated delta rule: reference (per-token oracle), chunked prefill, batched recurrent step / verify."""

from backboard.ops.gdn.chunk import gdn_chunked_varlen
from backboard.ops.gdn.recurrent import gdn_recurrent
from backboard.ops.gdn.reference import gdn_ref, l2norm

__all__ = ["gdn_chunked_varlen", "gdn_recurrent", "gdn_ref", "l2norm"]
