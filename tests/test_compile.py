"""compile.enabled (moe_lc.parallel.compile): which modules are compiled, that they compile without
falling back to eager, and that a compiled model computes what the eager one does.

Inductor runs on CPU (it generates C++), so the numerics are checked here: one forward and backward
of the tiny model, compiled and eager, from the same weights on the same batch. Inductor may fuse
and reorder the fp32 reductions of a norm (over d = 64 values) and of the depth softmax, so values
may differ by a few eps32 per reduction; the bound is 64 eps32 relative to the largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from configs import tiny
from toolchain import needs_cxx

from moe_lc.config import ConfigError
from moe_lc.model.init import build_model
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from moe_lc.parallel.compile import (RECOMPILE_LIMIT, RegionalCompile, apply_compile, compile_targets,
                                     compiled_modules)
from moe_lc.train.main import run_train_cli

EPS32 = torch.finfo(torch.float32).eps


def _exactly(model: nn.Module, class_name: str) -> set[str]:
    return {name for name, m in model.named_modules() if type(m).__name__ == class_name}


def test_the_targets_are_every_norm_and_every_depth_mixer():
    model = build_model(tiny(mtp=True), device="cpu", seed=0)
    norms, mixers = compile_targets(model, ["norms"]), compile_targets(model, ["attn_res"])
    # every plain and gated RMSNorm (the mixers' own norms are a subclass whose forward is the whole mixture)
    assert set(norms) == _exactly(model, "RMSNorm") | _exactly(model, "GatedRMSNorm") and len(norms) == len(set(norms))
    assert "layers.0.attn.o_norm" in norms  # KDA's gated output norm, gate and norm in one compiled graph
    assert set(mixers) == _exactly(model, "DepthMixer")
    assert "out_mixer" in mixers and "layers.0.attn_norm" in norms and "mtp.proj" not in norms
    assert compile_targets(model, ["float8"]) == []  # no float8 linears without precision=fp8
    assert set(compile_targets(model, ["norms", "attn_res"])) == set(norms) | set(mixers)


@needs_cxx
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_compiled_model_computes_what_the_eager_one_does(checkpointing):
    # full: the compiled norms and mixers run again inside the recomputed layers (the 256K stage's policy)
    torch._dynamo.reset()
    cfg = tiny(num_layers=3, layer_pattern="KKM")
    eager, compiled = build_model(cfg, device="cpu", seed=0), build_model(cfg, device="cpu", seed=0)
    names = apply_compile(compiled, RegionalCompile(enabled=True, targets=["norms", "attn_res"]))
    for model in (eager, compiled):
        apply_activation_checkpointing(model, ActivationCheckpointing(mode=checkpointing))
    assert names and compiled_modules(compiled) == names
    ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    torch._dynamo.utils.counters.clear()
    results = []
    for model in (eager, compiled):
        out = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert abs(loss_c - loss_e) <= 64 * EPS32 * abs(loss_e)
    for name, g in grads_e.items():
        bound = 64 * EPS32 * g.abs().max().item()
        assert (grads_c[name] - g).abs().max().item() <= bound, name


def test_off_compiles_nothing_and_tensor_parallel_is_refused():
    model = build_model(tiny(), device="cpu", seed=0)
    assert apply_compile(model, RegionalCompile()) == []
    assert compiled_modules(model) == []
    with pytest.raises(ConfigError, match="layout.tp=2"):
        apply_compile(model, RegionalCompile(enabled=True), tp=2)


def test_auto_compiles_one_process_on_a_cuda_gpu_only():
    auto = RegionalCompile(enabled="auto")
    assert auto.resolve("cuda", 1).enabled is True
    assert auto.resolve("cpu", 1).enabled is False
    assert auto.resolve("cuda", 2).enabled is False and auto.resolve("cuda", 1, tp=2).enabled is False
    assert RegionalCompile(enabled="true").resolve("cpu", 4).enabled is True  # explicit stays explicit
    auto.check(tp=2)  # auto with tp > 1 is off, not an error
    model = build_model(tiny(), device="cpu", seed=0)
    assert apply_compile(model, auto) == []
    assert compiled_modules(model) == []


def test_compiling_lifts_dynamos_recompile_limit(monkeypatch):
    # every norm shares RMSNorm.forward: past Dynamo's default of 8 variants the rest ran eager (fp8, H200)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    model = build_model(tiny(), device="cpu", seed=0)
    names = apply_compile(model, RegionalCompile(enabled=True))
    assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT > 8
    assert compiled_modules(model) == names and names  # what bench reports


def test_bad_compile_settings_are_one_line(capsys, tmp_path):
    for args, needle in ((["compile.enabled=true", "layout.tp=2"], "compile.enabled=true with layout.tp=2"),
                         (["compile.targets=[norms,mlp]"], "compile.targets='mlp': use one of"),
                         (["compile.enabled=sometimes"], "compile.enabled='sometimes': use true, false or auto")):
        assert run_train_cli([*args, "max_steps=1", f"run_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and needle in err, err


def _moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "LatentMoE"}


def _grouped_mm_runs_here() -> bool:
    try:
        torch._grouped_mm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _expert_calls(model: nn.Module, ids: torch.Tensor, monkeypatch,
                  device_type: str = "cpu") -> tuple[torch.Tensor, dict, int]:
    """One step of two micro-batches under bf16 autocast on the step's weight copies (training as the
    trainer runs it): the loss of the last, the fp32 gradients, and how often the routed experts' op
    computed its forward (its activation, counted where the op's own code calls it)."""
    import moe_lc.ops.grouped_experts as grouped_experts
    from moe_lc.model.moe import reuse_weight_casts

    calls = []
    activation = grouped_experts.glu_activation_stacked
    monkeypatch.setattr(grouped_experts, "glu_activation_stacked", lambda *a, **k: calls.append(1) or activation(*a, **k))
    model.zero_grad(set_to_none=True)
    with reuse_weight_casts(model), torch.autocast(device_type, dtype=torch.bfloat16):
        for micro_batch in ids:
            out = model(micro_batch[:, :-1], labels=micro_batch[:, 1:], return_logits=False)
            out.loss.backward()
    monkeypatch.undo()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls)


@needs_cxx
@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm does not take bf16 on CPU here")
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_a_training_moe_layer_is_one_graph_with_its_experts(checkpointing, monkeypatch):
    """Training (bf16 autocast, the step's stacked weight copies, the grouped GEMM): the routed experts
    (one custom op) and the shared experts run inside the layer's graph, so a forward is one graph
    with no break; the step's copies are made before the graph. Same loss and gradients as eager
    within bf16 rounding: Inductor rounds once where eager rounds twice (the shared experts' output
    projection and the sum with the routed part become one GEMM with the add in its epilogue), about
    one bf16 rounding in the layer's output, so the bound is 8 bf16 unit roundoffs of the largest
    gradient, as the stacked experts' own test; a wrong expert gradient is O(1). Selective
    checkpointing keeps the experts' op output: it runs once per layer and micro-batch, not again
    in the recompute."""
    torch._dynamo.reset()
    cfg = tiny(num_layers=3, layer_pattern="KKM")
    eager, compiled = build_model(cfg, device="cpu", seed=0), build_model(cfg, device="cpu", seed=0)
    for model in (eager, compiled):
        for experts in (m for m in model.modules() if type(m).__name__ == "RoutedExperts"):
            experts.backend = "grouped"  # auto takes the loop on a CPU
    names = apply_compile(compiled, RegionalCompile(enabled=True, targets=["moe"]))
    for model in (eager, compiled):
        apply_activation_checkpointing(model, ActivationCheckpointing(mode=checkpointing))
    assert compiled_modules(compiled) == names == list(_moe_layers(compiled))
    ids = torch.randint(0, cfg.vocab_size, (2, 2, 65), generator=torch.Generator().manual_seed(3))
    torch._dynamo.utils.counters.clear()
    loss_e, grads_e, calls_e = _expert_calls(eager, ids, monkeypatch)
    loss_c, grads_c, calls_c = _expert_calls(compiled, ids, monkeypatch)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    forward_graphs = 1 if checkpointing == "none" else 2  # a recompute (no statistics counted) is a graph of its own
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == forward_graphs  # both layers share it
    kept = checkpointing != "full"
    assert calls_c == calls_e == len(names) * len(ids) * (1 if kept else 2)
    bf16_unit = 2.0 ** -8
    assert abs(loss_c - loss_e) <= 8 * bf16_unit * abs(loss_e)
    for name, g in grads_e.items():
        assert (grads_c[name] - g).abs().max().item() <= 8 * bf16_unit * g.abs().max().item(), name
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["tiny", "k3-small"])
def test_a_training_moe_layer_is_one_graph_on_the_gpu(preset, monkeypatch):
    """The test above on a CUDA GPU, where every fast path is taken (the grouped GEMM, the Triton
    permutation and SiTU custom ops, autocast on CUDA), at the tiny config and at k3-small's layer
    shapes (two of its layers, 256 tokens): the CPU test cannot see a break that only these paths
    make. Dynamo's counters name each break."""
    import dataclasses

    from moe_lc.presets import get_preset

    torch._dynamo.reset()
    cfg = tiny(num_layers=3, layer_pattern="KKM") if preset == "tiny" else dataclasses.replace(
        get_preset(preset), num_layers=2, layer_pattern="KM")
    model = build_model(cfg, device="cuda", seed=0)
    apply_compile(model, RegionalCompile(enabled=True, targets=["moe"]))
    ids = torch.randint(0, cfg.vocab_size, (2, 1, 257), generator=torch.Generator().manual_seed(3)).cuda()
    torch._dynamo.utils.counters.clear()
    _expert_calls(model, ids, monkeypatch, "cuda")
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # every MoE layer shares the one graph
    torch._dynamo.reset()


@needs_cxx
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_a_compiled_moe_layer_routes_balances_and_combines_as_the_eager_one_and_compiles_once(checkpointing):
    """The MoE glue compiled (router, Quantile Balancing's selection and histogram, sort, gather,
    combine) with the experts left out of the graph: same loss, gradients and balancer statistics
    as eager over two batches that route differently, and the second batch compiles nothing; also
    inside checkpointed layers, whose recompute must route alike and count no token twice."""
    torch._dynamo.reset()
    cfg = tiny(num_layers=3, layer_pattern="KKM")
    eager, compiled = build_model(cfg, device="cpu", seed=0), build_model(cfg, device="cpu", seed=0)
    names = apply_compile(compiled, RegionalCompile(enabled=True, targets=["moe"]))
    for model in (eager, compiled):
        apply_activation_checkpointing(model, ActivationCheckpointing(mode=checkpointing))
    assert names == list(_moe_layers(compiled)) and len(names) == 2  # the dense first layer has none
    gen = torch.Generator().manual_seed(2)
    torch._dynamo.utils.counters.clear()
    for batch in range(2):
        ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=gen)
        results = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            out = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False)
            out.loss.backward()
            stats = {n: (m.balancer.step_loads.clone(), m.balancer.histogram.counts.clone())
                     for n, m in _moe_layers(model).items()}
            results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, stats))
        if batch == 0:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            assert graphs > 0  # it did compile
        (loss_e, grads_e, stats_e), (loss_c, grads_c, stats_c) = results
        assert abs(loss_c - loss_e) <= 64 * EPS32 * abs(loss_e)
        for name, g in grads_e.items():
            assert (grads_c[name] - g).abs().max().item() <= 64 * EPS32 * g.abs().max().item(), name
        for name, (loads, counts) in stats_e.items():  # integer statistics: the same routing
            assert torch.equal(stats_c[name][0], loads) and torch.equal(stats_c[name][1], counts), name
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # a new routing compiles nothing
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert breaks and all("disable" in reason.lower() or "skip" in reason.lower() for reason in breaks), breaks
    torch._dynamo.reset()
