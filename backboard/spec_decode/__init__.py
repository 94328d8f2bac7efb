"""Speculative decoding proposers: the model's MTP head, our 4-bit draft head, n-gram lookup.

A proposer drafts up to k tokens per request after each step; the target verifies them in the
next step's forward (sample/rejection.py), so output is unchanged. k adapts to load
(spec_decode/adaptive.py)."""

from __future__ import annotations

from backboard.config import EngineConfig


def build_proposer(cfg: EngineConfig):
    method = cfg.spec.method
    if method == "ngram":
        from backboard.spec_decode.ngram import NgramProposer

        return NgramProposer(cfg)
    if method in ("mtp", "draft_head"):
        from backboard.spec_decode.mtp_proposer import MTPProposer

        return MTPProposer(cfg)
    raise ValueError(f"unknown speculative method {method!r}")
