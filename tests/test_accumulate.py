"""Gradient accumulation (moe_lc.ops.accumulate and its Triton kernel): ``dst += src`` bitwise as
torch adds, for fp32 sums of bf16/fp16/fp32 gradients, whole or one half of a stacked tensor.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
first imported); the op itself takes the kernel on CUDA only, so on a CPU the kernel is called
directly with the layout the op would hand it. Bitwise: the upcast of a bf16/fp16 value to fp32 is
exact and the one fp32 add rounds the same way in both.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_lc.ops import accumulate as op  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stacked(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A [E, 2h, l] gradient of the stacked gate/input weight, E = 3, h = 5, l = 7 (rows of 35 and 70)."""
    return torch.randn(3, 10, 7, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.skipif(not triton_available(DEVICE), reason="Triton cannot run here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_adds_halves_and_whole_tensors_bitwise_as_torch(monkeypatch, dtype):
    from moe_lc_kernels.accumulate import accumulate_rows_triton

    monkeypatch.setitem(__import__("moe_lc_kernels.accumulate", fromlist=["TUNING"]).TUNING, "block", 16)
    grad = stacked(dtype)
    for part in (grad[:, :5], grad[:, 5:], grad):  # two strided halves (row stride 70), then all of it
        dst = torch.randn(part.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        want = dst.clone().add_(part)
        rows, cols, stride = op._rows(part)
        assert (rows, cols) == (3, part.shape[1] * 7) and stride == 70
        accumulate_rows_triton(dst, part, rows, cols, stride)
        assert torch.equal(dst, want)


def test_rows_of_a_tensor_and_what_is_not_rows():
    grad = torch.zeros(3, 10, 7)
    assert op._rows(grad) == (3, 70, 70)
    assert op._rows(grad[:, 5:]) == (3, 35, 70)
    assert op._rows(grad[:1, 5:]) == (1, 35, 35)
    assert op._rows(grad.transpose(1, 2)) is None  # inner dims not contiguous: torch's add
    assert op._rows(grad[:, :, :3]) is None


def test_op_is_torchs_add_and_checks_shapes():
    dst, src = torch.randn(3, 5, 7), stacked(torch.bfloat16).cpu()[:, :5]
    want = dst.clone().add_(src)
    assert op.accumulate_(dst, src) is dst and torch.equal(dst, want)
    with pytest.raises(ValueError, match="shapes differ"):
        op.accumulate_(dst, torch.zeros(3, 5))
