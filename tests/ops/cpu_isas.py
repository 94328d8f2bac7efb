"""The ISA levels the CPU kernel tests cover: this machine's best, AVX2 (when the machine runs
it and it is not already the best) and the portable build, each compiled once per session."""

from __future__ import annotations

import pytest

from backboard.ops.cpu import decode_ops
from backboard.ops.cpu.build import cpu_isa, supported_isas

_LEVELS = supported_isas()
TEST_ISAS = list(dict.fromkeys([cpu_isa(), *(lvl for lvl in ("avx2",) if lvl in _LEVELS), "portable"]))


def built(isa: str):
    """The decode_ops extension for isa; the test fails (never skips) when it does not build: a
    compiler is part of every machine this project runs on."""
    mod = decode_ops.kernels(isa)
    assert mod is not None, f"the decode_ops CPU kernels did not build for {isa} (see the log)"
    assert mod.isa() == isa
    return mod


isa_param = pytest.mark.parametrize("isa", TEST_ISAS)
