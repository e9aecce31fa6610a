"""precision=fp8 (moe_lc.parallel.float8): which linears convert, what a converted linear computes,
and that checkpoints do not depend on it.

torchao's float8 linears run on CPU (torch._scaled_mm has a CPU kernel), so the conversion and its
numerics are checked here against the float8 formula written out in float64: a tensor-wise scale
s = 448 / amax(|t|) (e4m3 for inputs and weights, e5m2 with 57344 for gradients), a row-wise scale
per row rounded down to a power of two (e4m3 throughout). The trainer itself refuses fp8 on CPU
(a GPU with FP8 tensor cores is where it pays); the speed is a GPU benchmark (docs/performance.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from configs import tiny  # noqa: E402

from moe_lc.checkpoint import CheckpointManager  # noqa: E402
from moe_lc.config import ConfigError  # noqa: E402
from moe_lc.model.init import build_model  # noqa: E402
from moe_lc.parallel.float8 import Float8Training, apply_float8, float8_linear_names  # noqa: E402
from moe_lc.train.main import run_train_cli  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# written from the module's rules, not from its helpers: every linear of the tiny model with MTP,
# by its last name, and whether it runs in float8
FP8 = {"q_proj", "k_proj", "v_proj", "o_proj", "q_down", "q_up", "kv_down", "kv_up", "w_gate", "w_in", "w_out",
       "latent_down", "latent_up", "proj"}
KEPT = {"router", "lm_head", "beta_proj", "decay_down", "decay_up", "gate_proj", "k_shared"}


def _model(seed: int = 0) -> nn.Module:
    return build_model(tiny(mtp=True), device="cpu", seed=seed)


def _last_name(path: str) -> str:
    return [p for p in path.split(".") if not p.isdigit()][-1]


def test_the_dense_projections_convert_and_the_sensitive_linears_stay():
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {_last_name(n) for n in linears} == FP8 | KEPT  # the lists above cover the model
    converted = apply_float8(model, Float8Training())
    assert converted == float8_linear_names(_model())
    modules = dict(model.named_modules())
    for name in linears:
        in_fp8 = _last_name(name) in FP8
        assert isinstance(modules[name], Float8Linear) == in_fp8, name
        assert (name in converted) == in_fp8, name
    assert "mtp.proj" in converted and "lm_head" not in converted
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == len(converted)


def test_each_role_decides_on_its_own_when_the_shapes_allow_float8():
    """(In the tiny model the router, beta and the shared key are too narrow for float8 anyway.)"""
    model = nn.ModuleDict({role: nn.Linear(64, 64) for role in sorted(FP8 | KEPT)})
    assert set(float8_linear_names(model)) == FP8


def test_a_linear_whose_dimensions_do_not_split_into_16s_stays():
    model = nn.ModuleDict({"q_proj": nn.Linear(64, 24), "o_proj": nn.Linear(48, 64), "w_in": nn.Linear(40, 32)})
    assert float8_linear_names(model) == ["o_proj"]


def _quantized(t: torch.Tensor, dtype: torch.dtype, dim=None, power_of_two: bool = False) -> torch.Tensor:
    """t in float64 after the float8 round trip: scale so that amax hits the format's max, cast, unscale."""
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax).float().double()  # the scale is a float32
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).to(dtype).double() / scale


def _same(a, b) -> bool:
    """Equal state-dict entries: tensors bit for bit (and dtype), other values (balancer state) by ==."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _cpu_runs_rowwise_scaled_mm() -> bool:
    """torch._scaled_mm's CPU kernel takes row-wise scales (torch 2.13 does, torch 2.11 asserts)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("scaling", [
    "tensorwise",
    pytest.param("rowwise", marks=pytest.mark.skipif(not _cpu_runs_rowwise_scaled_mm(),
                                                      reason="this torch's CPU _scaled_mm takes tensor-wise scales only")),
])
def test_a_converted_linear_computes_the_float8_formula(scaling):
    torch.manual_seed(0)
    model = nn.ModuleDict({"w_in": nn.Linear(64, 32, bias=False)})
    weight = model["w_in"].weight.detach().clone()
    apply_float8(model, Float8Training(scaling=scaling))
    x = torch.randn(16, 64, requires_grad=True)
    y = model["w_in"](x)
    grad = torch.randn_like(y)
    y.backward(grad)
    if scaling == "tensorwise":  # forward in e4m3; the output gradient in e5m2 for both backward GEMMs
        want_y = _quantized(x, E4M3) @ _quantized(weight, E4M3).T
        want_dx = _quantized(grad, E5M2) @ _quantized(weight, E4M3)
        want_dw = _quantized(grad, E5M2).T @ _quantized(x, E4M3)
        bound = 1e-5  # the GEMMs accumulate 64 products exactly representable in float32
    else:  # a scale per row of each operand along its reduced dimension, powers of two, e4m3
        want_y = _quantized(x, E4M3, -1, True) @ _quantized(weight, E4M3, -1, True).T
        want_dx = _quantized(grad, E4M3, -1, True) @ _quantized(weight, E4M3, 0, True)
        want_dw = _quantized(grad, E4M3, 0, True).T @ _quantized(x, E4M3, 0, True)
        bound = 2**-7  # the row-wise GEMM writes bf16 on CPU: half an ulp of bf16 relative to the largest
    for got, want in ((y, want_y), (x.grad, want_dx), (model["w_in"].weight.grad, want_dw)):
        assert _rel(got, want) < bound
    # and it is float8, not the plain matmul: e4m3's 3 mantissa bits cost percents
    assert _rel(y, x.detach().double() @ weight.double().T) > 0.01


def test_the_model_trains_in_float8_within_its_noise_and_its_weights_stay_put():
    torch.manual_seed(0)
    ids = torch.randint(0, 258, (1, 128))
    plain, fp8 = _model(), _model()
    apply_float8(fp8, Float8Training())
    assert list(plain.state_dict()) == list(fp8.state_dict())  # same names, same tensors
    for (name, a), b in zip(plain.state_dict().items(), fp8.state_dict().values()):
        assert _same(a, b), name
    losses = []
    for model in (plain, fp8):
        out = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False)
        out.loss.backward()
        losses.append(out.loss.item())
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.02 * losses[0]
    grads = {n: p.grad for n, p in fp8.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_checkpoints_move_between_float8_and_plain_models(tmp_path):
    fp8 = _model(seed=1)
    apply_float8(fp8, Float8Training(scaling="rowwise"))
    manager = CheckpointManager(tmp_path / "a")
    manager.save(1, {"model": fp8, "trainer": {"step": 1}})
    plain = _model(seed=2)
    manager.load("latest", plain)
    for (name, a), b in zip(fp8.state_dict().items(), plain.state_dict().values()):
        assert _same(a, b), name
    back = _model(seed=3)
    apply_float8(back, Float8Training())
    other = CheckpointManager(tmp_path / "b")
    other.save(1, {"model": plain, "trainer": {"step": 1}})
    other.load("latest", back)
    for (name, a), b in zip(plain.state_dict().items(), back.state_dict().values()):
        assert _same(a, b), name


def test_bad_float8_settings_are_one_line():
    with pytest.raises(ConfigError, match="fsdp_float8_all_gather=true needs float8.scaling=tensorwise"):
        apply_float8(_model(), Float8Training(scaling="rowwise", fsdp_float8_all_gather=True))
    with pytest.raises(ConfigError, match="precision=fp8 with layout.tp=2 is not implemented yet"):
        apply_float8(_model(), Float8Training(), tp=2)
    with pytest.raises(ConfigError, match="float8.scaling='blockwise'"):
        Float8Training(scaling="blockwise")


def test_the_trainer_refuses_fp8_on_cpu_in_one_line(capsys, tmp_path):
    assert run_train_cli(["precision=fp8", "device=cpu", "max_steps=1", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: precision=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+, e.g. "
                   "H100/H200); this run is on cpu: use precision=auto or bf16")


# ----------------------------------------------------------------------------- with data parallelism

FP8_LAYOUTS = [dict(dp_shard=2), dict(dp_shard=2, ep=2), dict(dp_shard=2, dp_mode="zero1")]


def _float8_layouts(samples: list) -> list[dict]:
    """Worker: one AdamW step of the tiny model in FP8 (tensorwise) under each layout."""
    from parallel_harness import biases, full_state, rank_micro_batches, train_step

    from moe_lc.parallel import (ActivationCheckpointing, ParallelLayout, build_mesh, build_optimizer,
                                 data_parallel_info, parallelize)

    reports = []
    for fields in FP8_LAYOUTS:
        layout = ParallelLayout(**fields)
        mesh = build_mesh(layout)
        model = parallelize(build_model(tiny(), "cpu", seed=0), layout, mesh,
                            ActivationCheckpointing(mode="selective"), float8=Float8Training())
        optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-3, eps=1e-4)
        grads: dict = {}
        loss = train_step(model, optimizer, rank_micro_batches(samples, *data_parallel_info(mesh), 1), mesh, grads)
        reports.append(dict(loss=loss, grads=grads, params=full_state(model), biases=biases(model)))
    return reports


@pytest.mark.timeout(150)
def test_float8_under_fsdp_zero1_and_ep_equals_one_process():
    """Each rank's float8 GEMMs see what one process's see for the same micro-batch (the scales come
    from the all-gathered weight and the rank's own activations), so a step over two ranks equals one
    process accumulating the two ranks' micro-batches, up to the order of the gradient sum."""
    from parallel_harness import biases, make_samples, rank_micro_batches, run_distributed, train_step

    samples = make_samples(4, 16, 258, seed=7)
    per_rank = run_distributed(_float8_layouts, 2, samples)
    model = build_model(tiny(), "cpu", seed=0)
    apply_float8(model, Float8Training())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    grads: dict = {}
    loss = train_step(model, optimizer, [rank_micro_batches(samples, r, 2, 1)[0] for r in range(2)], None, grads)
    params = {name: p.detach() for name, p in model.named_parameters()}
    for fields, got in zip(FP8_LAYOUTS, per_rank[0]):
        assert got["loss"] == pytest.approx(loss, rel=1e-6), fields
        for name, p in params.items():
            assert torch.allclose(got["grads"][name], grads[name], rtol=1e-5, atol=1e-7), (fields, name)
            assert torch.allclose(got["params"][name], p, rtol=1e-5, atol=1e-7), (fields, name)
        assert torch.equal(got["biases"], biases(model)), fields
