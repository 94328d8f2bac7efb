"""Kernel tests: every Triton kernel against its torch reference on CPU tensors, through the
Triton interpreter. TRITON_INTERPRET must be set before a kernel module is imported (triton
reads it when a kernel is decorated), so it is set here, at collection, before any test module
imports backboard.ops.triton."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# bf16 tolerances cover a couple of ulps: the interpreter truncates when it rounds to bf16
# (the GPU rounds to nearest), so roundings inside a kernel may differ from torch's by one ulp
TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
           **tol) -> None:
    dtype = dtype or expected.dtype
    kw = dict(TOLS.get(dtype, TOLS[torch.bfloat16]))     # fp16 etc.: the loose set
    kw.update(tol)
    torch.testing.assert_close(actual.float(), expected.float(), **kw)


def _differs(actual: torch.Tensor, wrong: torch.Tensor, dtype: torch.dtype | None = None, **tol) -> None:
    """The comparison used by the tests would catch `wrong` (a plausible bug) as a mismatch."""
    with pytest.raises(AssertionError):
        _close(actual, wrong, dtype, **tol)


@pytest.fixture
def close():
    return _close


@pytest.fixture
def differs():
    return _differs


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
