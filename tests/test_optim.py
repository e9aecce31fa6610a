"""Optimizers (docs/design.md §7.6): Newton-Schulz, Muon (per-head, per-expert, sharded), parameter groups,
the cosine schedule and gradient clipping."""

from __future__ import annotations

import copy
import datetime
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moe_lc.config import ConfigError
from moe_lc.model.init import build_model
from moe_lc.optim import (
    Muon,
    OptimConfig,
    apply_lr,
    build_optimizer,
    clip_grad_norm,
    lr_at,
    muon_param_groups,
    newton_schulz,
    param_groups,
    parameter_roles,
    rms_matching_scale,
    warmup_steps,
)
from moe_lc.parallel.tensor_parallel import VocabParallelEmbedding, VocabParallelLMHead
from moe_lc.optim.muon import shard_holds_whole_blocks
from moe_lc.optim.newton_schulz import QUINTIC
from moe_lc.presets import get_preset

BAND = (0.6, 1.3)  # where the 5-step quintic puts every singular value it has had room to grow


def matrix_with_spectrum(rows: int, cols: int, singular_values: torch.Tensor, seed: int):
    """G = U diag(s) V^T with random orthonormal U, V (float64); returns G, U, V."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    return u @ torch.diag(singular_values) @ v.T, u, v


def polar_factor(g: torch.Tensor) -> torch.Tensor:
    """U V^T from an SVD: the exact orthogonalisation Newton-Schulz approximates."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return u @ vh


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a * b).sum() / (a.norm() * b.norm()))


def scalar_quintic(s: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = QUINTIC
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


# ---------------------------------------------------------------- Newton-Schulz


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 32), (32, 128), (96, 48)])
def test_newton_schulz_random_rectangular_in_band(shape, dtype):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    o = newton_schulz(g, steps=5, dtype=dtype)
    assert o.dtype == g.dtype and o.shape == g.shape
    s = torch.linalg.svdvals(o.double())
    assert BAND[0] <= s.min() and s.max() <= BAND[1], (s.min(), s.max())
    assert cosine(o, polar_factor(g)) > 0.97


@pytest.mark.parametrize("shape", [(64, 64), (96, 48)])
def test_newton_schulz_condition_100_in_band(shape):
    k = min(shape)
    g, _, _ = matrix_with_spectrum(*shape, torch.logspace(0, -2, k, dtype=torch.float64), seed=2)
    o = newton_schulz(g.float(), steps=5)
    s = torch.linalg.svdvals(o.double())
    assert BAND[0] <= s.min() and s.max() <= BAND[1], (s.min(), s.max())
    assert cosine(o, polar_factor(g)) > 0.97


@pytest.mark.parametrize("cond", [1e3, 1e4])
def test_newton_schulz_ill_conditioned(cond):
    """Directions with sigma >= 2e-3 ||G||_F reach the band; weaker ones grow but never overshoot it."""
    k = 64
    sv = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
    g, u, v = matrix_with_spectrum(k, k, sv, seed=3)
    o = newton_schulz(g.float(), steps=5).double()
    gain = torch.diagonal(u.T @ o @ v)  # output singular value along each input singular direction
    strong = sv / sv.norm() >= 2e-3
    assert strong.sum() >= k // 2
    assert BAND[0] <= gain[strong].min() and gain.max() <= BAND[1]
    assert (gain[~strong] > sv[~strong] / sv.norm()).all()  # weak directions are amplified, not lost
    assert torch.linalg.svdvals(o).max() <= BAND[1]
    if cond <= 1e3:
        assert cosine(o, polar_factor(g)) > 0.9


def test_newton_schulz_square_random():
    """Square Gaussian matrices have singular values near 0 (Marchenko-Pastur): no lower bound there."""
    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    o = newton_schulz(g)
    assert torch.linalg.svdvals(o.double()).max() <= BAND[1]
    assert cosine(o, polar_factor(g)) > 0.95


def test_newton_schulz_maps_each_singular_value_by_the_scalar_quintic():
    """In float64 NS(G) = U phi(S / ||G||_F) V^T exactly: singular vectors are kept."""
    sv = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.05, 0.01], dtype=torch.float64)
    g, u, v = matrix_with_spectrum(10, 6, sv, seed=5)
    expected = u @ torch.diag(scalar_quintic(sv / sv.norm(), 5)) @ v.T
    o = newton_schulz(g, steps=5, eps=0.0)
    assert o.dtype == torch.float64
    assert (o - expected).norm() / expected.norm() < 1e-12


def test_newton_schulz_of_zero_is_zero():
    """torch.distributed.checkpoint initialises optimizer state with a zero-gradient step."""
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6))


# ---------------------------------------------------------------- Muon update rule


def run_steps(params, grads_per_step, opt):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


def random_grads(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_the_written_update(nesterov):
    """B = mu B + G; U = G + mu B (Nesterov) or B; W = (1 - lr wd) W - lr 0.2 sqrt(max(m,n)) NS(U)."""
    lr, wd, mu = 0.05, 0.1, 0.9
    w0 = torch.randn(12, 20, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    grads = random_grads([(12, 20)], 3, seed=6)
    run_steps([p], grads, Muon([p], lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov))
    w, buf = w0.clone(), torch.zeros_like(w0)
    for (g,) in grads:
        buf = mu * buf + g
        u = g + mu * buf if nesterov else buf
        w = (1 - lr * wd) * w - lr * 0.2 * math.sqrt(20) * newton_schulz(u)
    assert torch.allclose(p.detach(), w, rtol=0, atol=1e-13)


def test_muon_update_rms_matches_adamw_scale():
    """0.2 sqrt(max(m, n)) puts the update's RMS near 0.2 whatever the shape."""
    for m, n in [(256, 64), (64, 256), (128, 128)]:
        g = torch.randn(m, n).double()
        direction = newton_schulz(g) * rms_matching_scale(m, n)
        rms = direction.pow(2).mean().sqrt().item()
        assert 0.2 * BAND[0] < rms < 0.2 * BAND[1], (m, n, rms)


@pytest.mark.parametrize("head_axis", [0, 1])
def test_per_head_muon_equals_muon_on_each_block(head_axis):
    """Per-head Muon on [H*hd, n] (rows) or [m, H*hd] (columns) == plain Muon on each head's block."""
    heads, hd, other = 3, 8, 20
    shape = (heads * hd, other) if head_axis == 0 else (other, heads * hd)
    w0 = torch.randn(shape, dtype=torch.float64)
    grads = random_grads([shape], 3, seed=7)
    joint = torch.nn.Parameter(w0.clone())
    run_steps([joint], grads, Muon([{"params": [joint], "head_dim": hd, "head_axis": head_axis}], lr=0.02))

    blocks = [torch.nn.Parameter(b.clone()) for b in w0.chunk(heads, dim=head_axis)]
    block_grads = [[gb for gb in g.chunk(heads, dim=head_axis)] for (g,) in grads]
    run_steps(blocks, block_grads, Muon(blocks, lr=0.02))
    assert torch.equal(joint.detach(), torch.cat([b.detach() for b in blocks], dim=head_axis))


def test_expert_stack_equals_per_expert_loop():
    experts, shape = 5, (16, 24)
    w0 = torch.randn(experts, *shape, dtype=torch.float64)
    grads = random_grads([(experts, *shape)], 3, seed=8)
    stacked = torch.nn.Parameter(w0.clone())
    run_steps([stacked], grads, Muon([stacked], lr=0.02))
    singles = [torch.nn.Parameter(w.clone()) for w in w0]
    run_steps(singles, [list(g.unbind(0)) for (g,) in grads], Muon(singles, lr=0.02))
    assert torch.equal(stacked.detach(), torch.stack([s.detach() for s in singles]))


def test_adamw_groups_inside_muon_match_torch_adamw():
    shapes = [(7,), (5, 9)]
    init = [torch.randn(s) for s in shapes]
    grads = [[g.float() for g in step] for step in random_grads(shapes, 4, seed=9)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = Muon([{"params": ours, "use_muon": False}], **kw)
    ref_opt = torch.optim.AdamW(ref, **kw)
    run_steps(ours, grads, opt)
    run_steps(ref, grads, ref_opt)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    # same state layout as torch's AdamW, so tools that read optimizer state see what they expect
    assert set(opt.state[ours[1]]) == set(ref_opt.state[ref[1]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_rejects_vectors_and_bad_head_splits():
    with pytest.raises(ValueError, match="muon_param_groups"):
        Muon([torch.nn.Parameter(torch.zeros(8))])
    with pytest.raises(ValueError, match="not a multiple of 3"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(10, 4))], "head_dim": 3}])
    with pytest.raises(ValueError, match="head_axis"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(12, 4))], "head_dim": 3, "head_axis": 2}])
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], momentum=1.0)


# ---------------------------------------------------------------- parameter groups

NO_DECAY_SUFFIXES = ("norm.weight", "mixer.query", ".A_log", ".dt_bias", "conv.weight")


def test_roles_on_the_tiny_model():
    model = build_model(get_preset("tiny"))
    roles = {role.name: role for role, _ in parameter_roles(model)}
    assert set(roles) == {n for n, _ in model.named_parameters()}  # every parameter, once
    for name, role in roles.items():
        expect_no_decay = name.endswith(NO_DECAY_SUFFIXES)
        assert role.decay == (not expect_no_decay), name
        assert role.muon == (role.decay and name not in ("embed.weight", "lm_head.weight")), name
    assert roles["layers.1.ffn.experts.w_gate"].muon
    # head blocks: KDA and MLA projections by rows, output projections by columns; the rest whole (0)
    cfg = get_preset("tiny")
    kda, mla = cfg.kda.head_dim, cfg.mla
    by_heads = {
        "layers.0.attn.q_proj.weight": (kda, 0),
        "layers.0.attn.v_proj.weight": (kda, 0),
        "layers.0.attn.decay_up.weight": (kda, 0),
        "layers.0.attn.gate_proj.0.weight": (kda, 0),
        "layers.0.attn.o_proj.weight": (kda, 1),
        "layers.0.attn.decay_down.weight": (0, 0),
        "layers.3.attn.q_up.weight": (mla.qk_nope_dim + mla.qk_rope_dim, 0),
        "layers.3.attn.kv_up.weight": (mla.qk_nope_dim + mla.v_dim, 0),
        "layers.3.attn.gate_proj.weight": (mla.v_dim, 0),
        "layers.3.attn.o_proj.weight": (mla.v_dim, 1),
        "layers.3.attn.kv_down.weight": (0, 0),
        "layers.1.ffn.router.weight": (0, 0),
    }
    for name, (head_dim, axis) in by_heads.items():
        assert (roles[name].head_dim, roles[name].head_axis) == (head_dim, axis), name
    params = dict(model.named_parameters())
    for name in by_heads:  # every tagged block count is the preset's head count
        r = roles[name]
        if r.head_dim:
            n_heads = cfg.kda.num_heads if ".0.attn" in name else mla.num_heads
            assert params[name].shape[r.head_axis] == n_heads * r.head_dim, name
    flat = {r.name: r for r, _ in parameter_roles(model, per_head=False)}
    assert all(r.head_dim == 0 for r in flat.values())


def test_roles_survive_the_vocabulary_parallel_embedding_and_head():
    """Tensor parallelism swaps the embedding and the LM head for modules of its own: they keep their
    roles (AdamW with weight decay). A checkpoint of another layout loads group settings by parameter,
    so one misplaced parameter would hand its group's weight decay to every other member."""
    model = build_model(get_preset("tiny"))
    before = [(role.name, role.decay, role.muon) for role, _ in parameter_roles(model)]
    model.embed = VocabParallelEmbedding(model.embed.weight, group=None)
    model.lm_head = VocabParallelLMHead(model.lm_head.weight, group=None)
    after = {(role.name, role.decay, role.muon) for role, _ in parameter_roles(model)}
    assert after == set(before)


def test_head_tags_follow_low_rank_gate_and_direct_q():
    """Kimi-Linear layout (meta device): low-rank output gate, q projected from x without q_lora."""
    model = build_model(get_preset("kimi-linear-48b"), device="meta")
    roles = {role.name: role for role, _ in parameter_roles(model)}
    assert roles["layers.0.attn.gate_proj.1.weight"].head_dim == 128
    assert roles["layers.0.attn.gate_proj.0.weight"].head_dim == 0
    assert roles["layers.3.attn.q_proj.weight"].head_dim == 128 + 64


def test_groups_partition_the_parameters():
    model = build_model(get_preset("tiny"))
    roles = {id(p): role for role, p in parameter_roles(model)}
    groups = muon_param_groups(model, weight_decay=0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(roles)
    for g in groups:
        for p in g["params"]:
            r = roles[id(p)]
            assert g["use_muon"] == r.muon and (g["weight_decay"] > 0) == r.decay
            if g["use_muon"]:
                assert (g["head_dim"], g["head_axis"]) == (r.head_dim, r.head_axis)
    adam = param_groups(model, weight_decay=0.1)
    assert sum(len(g["params"]) for g in adam) == len(roles)
    for g in adam:
        assert all((g["weight_decay"] > 0) == roles[id(p)].decay for p in g["params"])


# ---------------------------------------------------------------- on the tiny model


def fixed_batch(seed: int = 0, seq: int = 32):
    tokens = torch.randint(0, get_preset("tiny").vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def train(model, opt, cfg, steps, start=0, total=20):
    x, y = fixed_batch()
    losses = []
    for step in range(start, start + steps):
        loss = model(x, labels=y).loss
        loss.backward()
        clip_grad_norm(model.parameters(), cfg.grad_clip)
        apply_lr(opt, step, total, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_optimizer_decreases_loss_on_a_fixed_batch(name):
    cfg = OptimConfig(name=name, lr=1e-2, min_lr=1e-3, warmup_frac=0.1)
    model = build_model(get_preset("tiny"), seed=0)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, Muon if name == "muon" else torch.optim.AdamW)
    losses = train(model, opt, cfg, 20)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_state_dict_round_trip_gives_identical_next_steps():
    cfg = OptimConfig(name="muon", lr=1e-2, min_lr=1e-3, warmup_frac=0.1)
    model = build_model(get_preset("tiny"), seed=0)
    opt = build_optimizer(model, cfg)
    train(model, opt, cfg, 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_optim = copy.deepcopy(opt.state_dict())
    msd, osd = get_state_dict(model, opt)  # the DCP view the checkpointer saves
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
    assert any("momentum_buffer" in s for s in osd["state"].values())
    expected = train(model, opt, cfg, 3, start=3)

    plain = build_model(get_preset("tiny"), seed=1)
    plain_opt = build_optimizer(plain, cfg)
    plain.load_state_dict(saved_model)
    plain_opt.load_state_dict(saved_optim)
    assert train(plain, plain_opt, cfg, 3, start=3) == expected

    dcp = build_model(get_preset("tiny"), seed=2)
    dcp_opt = build_optimizer(dcp, cfg)
    set_state_dict(dcp, dcp_opt, model_state_dict=msd, optim_state_dict=osd)
    assert train(dcp, dcp_opt, cfg, 3, start=3) == expected


def test_build_optimizer_rejects_bad_config():
    model = build_model(get_preset("tiny"))
    with pytest.raises(ConfigError, match="optim.name"):
        build_optimizer(model, OptimConfig(name="sgd"))
    with pytest.raises(ConfigError, match="min_lr"):
        build_optimizer(model, OptimConfig(lr=1e-4, min_lr=1e-3))
    with pytest.raises(ValueError, match="CUDA"):
        build_optimizer(model, OptimConfig(fused=True))


# ---------------------------------------------------------------- schedule


def closed_form(step, total, cfg):
    warm = max(1, math.ceil(cfg.warmup_frac * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    p = (step - warm + 1) / (total - warm)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * p))


def test_schedule_warmup_peak_cosine_and_floor():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_frac=0.01)
    total = 1000
    warm = warmup_steps(total, cfg)
    assert warm == 10
    lrs = [lr_at(s, total, cfg) for s in range(total)]
    assert lrs[0] == pytest.approx(cfg.lr / warm)
    diffs = [lrs[s + 1] - lrs[s] for s in range(warm - 1)]
    assert all(d == pytest.approx(cfg.lr / warm) for d in diffs)  # linear warmup
    assert lrs[warm - 1] == pytest.approx(cfg.lr) and max(lrs) == lrs[warm - 1]  # peak at the end of warmup
    assert all(lrs[s + 1] < lrs[s] for s in range(warm - 1, total - 1))  # strictly decreasing after
    assert lrs[-1] == pytest.approx(cfg.min_lr)
    assert lr_at(total + 50, total, cfg) == pytest.approx(cfg.min_lr)
    midpoint = warm - 1 + (total - warm) // 2  # p = 1/2: halfway between peak and floor
    assert lrs[midpoint] == pytest.approx((cfg.lr + cfg.min_lr) / 2, rel=1e-3)
    for s in (0, 5, 9, 10, 123, 500, 998, 999):
        assert lrs[s] == pytest.approx(closed_form(s, total, cfg), rel=1e-12)


def test_schedule_short_runs_and_bad_steps():
    cfg = OptimConfig(lr=1e-3, min_lr=0.0, warmup_frac=0.01)
    assert warmup_steps(20, cfg) == 1  # at least one step
    assert lr_at(0, 20, cfg) == pytest.approx(cfg.lr)
    assert lr_at(19, 20, cfg) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(0, 1, cfg) == pytest.approx(cfg.lr)
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, 0, cfg)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, 10, cfg)


def test_apply_lr_sets_every_group():
    model = build_model(get_preset("tiny"))
    cfg = OptimConfig(name="muon", lr=1e-3, min_lr=1e-4)
    opt = build_optimizer(model, cfg)
    lr = apply_lr(opt, 500, 1000, cfg)
    assert lr == lr_at(500, 1000, cfg) and all(g["lr"] == lr for g in opt.param_groups)


# ---------------------------------------------------------------- clipping


def test_clip_grad_norm_scales_to_max_and_returns_pre_clip_norm():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (5,), (2, 2, 2)]]
    grads = [torch.randn(p.shape) * 3 for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    norm = clip_grad_norm(params, 1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(expected, rel=1e-6)
    clipped = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    assert clipped == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params, grads):  # one common factor: directions kept
        assert torch.allclose(p.grad, g / expected, rtol=1e-5)
    before = [p.grad.clone() for p in params]
    assert clip_grad_norm(params, 10.0).item() == pytest.approx(1.0, rel=1e-5)  # under the limit: untouched
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    clip_grad_norm(params, 0.0)  # 0 only measures
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


# ---------------------------------------------------------------- sharded parameters (DTensor, gloo)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sharded_worker(rank: int, world: int, port: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # same tensors on every rank
        cases = [  # (shape, placement, head_dim, head_axis, NS runs on the local shard)
            ((12, 10), Shard(0), 0, 0, False),  # FSDP-style row shards of a plain matrix: gathered
            ((12, 10), Shard(1), 0, 0, False),
            ((12, 10), Shard(0), 4, 0, False),  # 3 heads over 2 ranks: a shard cuts a head
            ((10, 12), Shard(0), 6, 1, False),  # per-head columns, sharded by rows
            ((16, 10), Shard(0), 4, 0, True),  # TP column-parallel: 2 whole heads per rank
            ((10, 16), Shard(1), 4, 1, True),  # TP row-parallel output projection
            ((4, 6, 5), Shard(0), 0, 0, True),  # experts sharded on the expert dim (EP)
            ((6, 8), Replicate(), 0, 0, True),
        ]
        inits = [torch.randn(shape, dtype=torch.float64) for shape, *_ in cases]
        grads = [[torch.randn(shape, dtype=torch.float64) for shape, *_ in cases] for _ in range(2)]
        ref = [torch.nn.Parameter(w.clone()) for w in inits]
        sharded = [
            torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [pl])) for w, (_, pl, *_) in zip(inits, cases)
        ]
        for q, (_, _, hd, axis, local) in zip(sharded, cases):
            assert shard_holds_whole_blocks(q, hd, axis) == local

        def groups(params):
            return [{"params": [p], "head_dim": hd, "head_axis": a} for p, (_, _, hd, a, _) in zip(params, cases)]

        ref_opt, opt = Muon(groups(ref), lr=0.05), Muon(groups(sharded), lr=0.05)
        for step_grads in grads:
            for p, q, g in zip(ref, sharded, step_grads):
                p.grad = g.clone()
                q.grad = distribute_tensor(g.clone(), mesh, q.placements)
            ref_opt.step()
            opt.step()
        for p, q, case in zip(ref, sharded, cases):
            assert q.placements == (case[1],)
            assert torch.allclose(q.full_tensor(), p.detach(), rtol=0, atol=1e-12), case
        # global norm over sharded gradients == the plain one
        expected = clip_grad_norm(ref, 1.0)
        got = clip_grad_norm(sharded, 1.0)
        assert torch.allclose(got, expected, rtol=1e-6)
        for p, q in zip(ref, sharded):
            assert torch.allclose(q.grad.full_tensor(), p.grad, rtol=1e-6, atol=1e-12)
    finally:
        dist.destroy_process_group()


def test_muon_and_clipping_on_sharded_parameters():
    # fork: the workers inherit the imported modules instead of importing torch again
    mp.start_processes(_sharded_worker, args=(2, _free_port()), nprocs=2, join=True, start_method="fork")
