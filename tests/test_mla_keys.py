"""MLA's keys (moe_lc.ops.mla_keys): the Triton kernels against the plain split and concatenation.

k = [k_nope, shared] per head and v = kv[..., nope:] are copies, so the kernels' outputs and kv's
gradient (dk's first nope channels, then dv) must equal the reference's exactly; the shared key's
gradient is dk's last channels summed over the heads, in fp32 here and in autograd's expand
backward in the reference: H - 1 roundings apart at most, each relative to the sum of the terms'
magnitudes. Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import MLAConfig
from moe_lc.model.mla import GatedMLA
from moe_lc.ops.mla_keys import mla_keys, mla_keys_reference, resolve_backend
from moe_lc_kernels import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU (tests/conftest.py)
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)


def _inputs(dtype: torch.dtype, B: int = 2, S: int = 5, H: int = 3, nope: int = 6, V: int = 5, SH: int = 4):
    """kv [B, S, H, nope + V] as a GEMM's output, and the shared key as columns of a wider tensor (as the
    stacked projection's split hands it over: rows further apart than its width)."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(B, S, H * (nope + V), generator=gen).to(dtype).view(B, S, H, nope + V).to(DEVICE)
    wide = torch.randn(B, S, SH + 7, generator=gen).to(dtype).to(DEVICE)
    return kv.requires_grad_(), wide[..., 3:3 + SH], wide, nope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_values_and_their_gradients_match_the_concatenation(dtype):
    kv, shared, wide, nope = _inputs(dtype)
    wide.requires_grad_()
    B, S, H, width = kv.shape
    gen = torch.Generator().manual_seed(1)
    # the gradients in attention's layout: [B, H, S, D] made contiguous, seen as [B, S, H, D]
    dk = torch.randn(B, H, S, nope + shared.shape[-1], generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    dv = torch.randn(B, H, S, width - nope, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)

    def run(backend: str):
        k, v = mla_keys(kv, wide[..., 3:3 + shared.shape[-1]], nope, backend=backend)
        grads = torch.autograd.grad((k, v), (kv, wide), (dk, dv))
        return k, v, *grads

    k, v, dkv, dwide = run("triton")
    k_ref, v_ref, dkv_ref, dwide_ref = run("torch")
    assert k.is_contiguous() and torch.equal(k, k_ref)
    assert torch.equal(v, v_ref) and v.data_ptr() == kv[..., nope:].data_ptr()  # v is a view of kv
    assert torch.equal(dkv, dkv_ref)
    got, want = dwide[..., 3:7].float(), dwide_ref[..., 3:7].float()
    # H - 1 fp32 roundings of the heads' magnitudes, then one rounding to the dtype
    bound = (H - 1) * torch.finfo(torch.float32).eps * dk[..., nope:].float().abs().sum(2)
    assert (got - want).abs().le(bound + torch.finfo(dtype).eps * want.abs()).all()
    assert torch.equal(dwide[..., :3], torch.zeros_like(dwide[..., :3]))  # the other columns get nothing
    assert dwide[..., 3:7].abs().max() > 0


def test_the_keys_gradient_without_one_of_its_outputs_used():
    kv, shared, _, nope = _inputs(torch.float32)
    k, v = mla_keys(kv, shared, nope, backend="triton")
    k_ref, v_ref = mla_keys_reference(kv, shared, nope)
    got, = torch.autograd.grad(k.sum(), kv)
    want, = torch.autograd.grad(k_ref.sum(), kv)
    assert torch.equal(got, want)  # v's gradient is zero where only k is used


def test_auto_takes_the_kernels_on_cuda_only_and_names_what_it_cannot_take():
    kv, shared, _, nope = _inputs(torch.float32)
    assert resolve_backend(kv, shared, "auto") == ("triton" if DEVICE == "cuda" else "torch")
    with pytest.raises(RuntimeError, match="one of fp32/bf16/fp16"):
        resolve_backend(kv.detach().double(), shared.double(), "triton")
    with pytest.raises(ValueError, match="0 < nope"):
        mla_keys(kv, shared, kv.shape[-1])


def test_the_layer_on_the_kernels_matches_the_layer_on_the_reference():
    """A GatedMLA layer with a shared key: output and every parameter's gradient the same either way
    (the copies are exact; only the shared key's head sum rounds in another order, fp32)."""
    cfg = MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=4, v_dim=8)
    torch.manual_seed(0)
    layer = GatedMLA(16, cfg).to(DEVICE)
    x = torch.randn(1, 6, 16, device=DEVICE)

    def run(backend: str):
        layer.cfg.keys_backend = backend
        layer.zero_grad()
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    (y, grads), (y_ref, grads_ref) = run("triton"), run("torch")
    assert torch.allclose(y, y_ref, rtol=1e-6, atol=1e-7)
    for name, want in grads_ref.items():
        assert torch.allclose(grads[name], want, rtol=1e-5, atol=1e-6 * want.abs().max().item()), name
