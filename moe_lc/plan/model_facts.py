"""What the planner needs to know about a model, read off a meta-device build (no memory, no math).

Each parameter is placed by the code that places it in training: tensor parallelism's plan
(`tensor_parallel_plan`: split over tp, else replicated), the routed experts (split over ep), FSDP's
units (`apply_fsdp`: each token mixer, channel mixer and routed-expert stack; the rest is the
root), the optimizer's roles (`parameter_roles`: Muon's matrices and their per-head blocks, AdamW
for the rest) and its pipeline block: a decoder layer, the MTP module, the embedding or the output
(final mixture, norm and LM head). Per decoder layer also its training FLOPs per token
(`moe_lc.model.accounting`) and the Newton-Schulz FLOPs of its Muon matrices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Optional

from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.ffn import GatedFFN
from moe_lc.model.init import build_model
from moe_lc.model.kda import KDAttention
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import LatentMoE, RoutedExperts
from moe_lc.optim.groups import parameter_roles
from moe_lc.parallel.tensor_parallel import tensor_parallel_plan

EMBEDDING, OUTPUT, MTP = "embedding", "output", "mtp"


@dataclass(frozen=True)
class Share:
    """Parameters by how tensor and expert parallelism divide them."""

    split: float = 0.0  # divided over tp (heads, hidden units, vocabulary rows)
    replicated: float = 0.0  # whole on every tp rank
    experts: float = 0.0  # routed experts: divided over ep

    def __add__(self, other: "Share") -> "Share":
        return Share(self.split + other.split, self.replicated + other.replicated, self.experts + other.experts)

    @property
    def total(self) -> float:
        return self.split + self.replicated + self.experts

    def dense(self, tp: int) -> float:
        """The non-expert parameters one rank holds before data-parallel sharding."""
        return self.split / tp + self.replicated

    def local(self, tp: int, ep: int) -> float:
        """Everything one rank holds before data-parallel sharding."""
        return self.dense(tp) + self.experts / ep


@dataclass(frozen=True)
class NewtonSchulzFlops:
    """Muon's orthogonalisation FLOPs per step, by where it can run."""

    experts: float = 0.0  # expert blocks: on the rank's own shard when it holds whole experts
    heads: float = 0.0  # per-head blocks of attention projections: on the rank's own shard (assumed)
    whole: float = 0.0  # other matrices: gathered and orthogonalised whole on every rank of a sharded group

    def __add__(self, other: "NewtonSchulzFlops") -> "NewtonSchulzFlops":
        return NewtonSchulzFlops(self.experts + other.experts, self.heads + other.heads, self.whole + other.whole)


@dataclass(frozen=True)
class Block:
    """A piece that sits on one pipeline stage: a decoder layer, the MTP module, the embedding, the output."""

    label: str  # layer<i>, mtp, embedding, output
    params: Share
    adamw: Share  # the part AdamW updates when the optimizer is Muon
    units: tuple[Share, ...]  # FSDP units (gathered and freed one by one); the rest of params is the root's
    root: Share  # parameters in FSDP's root unit (gathered once per micro-batch, kept through backward)
    newton_schulz: NewtonSchulzFlops = field(default_factory=NewtonSchulzFlops)
    largest_gathered_matrix: float = 0.0  # elements of the largest matrix Muon gathers whole


@dataclass(frozen=True)
class PipelineStage:
    """The blocks one pipeline stage holds (consecutive decoder layers, the embedding on the first
    stage, the output and the MTP module on the last) and their sums."""

    index: int
    layers: range  # trunk layer indices
    blocks: tuple[Block, ...]
    first: bool
    last: bool
    mla_layers: tuple[int, ...]  # the trunk layers among them that are MLA (the others are KDA)

    @cached_property
    def params(self) -> Share:
        return _sum(b.params for b in self.blocks)

    @cached_property
    def adamw(self) -> Share:
        return _sum(b.adamw for b in self.blocks)

    @cached_property
    def root(self) -> Share:
        return _sum(b.root for b in self.blocks)

    @cached_property
    def newton_schulz(self) -> NewtonSchulzFlops:
        total = NewtonSchulzFlops()
        for b in self.blocks:
            total = total + b.newton_schulz
        return total

    @cached_property
    def largest_gathered_matrix(self) -> float:
        return max(b.largest_gathered_matrix for b in self.blocks)

    @cached_property
    def _dense_units(self) -> tuple[tuple[float, float], ...]:
        return tuple({(u.split, u.replicated) for b in self.blocks for u in b.units if not u.experts})

    @cached_property
    def largest_expert_unit(self) -> float:
        """Routed-expert parameters of the stage's largest expert unit (before ep)."""
        return max((u.experts for b in self.blocks for u in b.units), default=0.0)

    def largest_dense_unit(self, tp: int) -> float:
        """Parameters one rank holds of the stage's largest dense FSDP unit."""
        return max((split / tp + replicated for split, replicated in self._dense_units), default=0.0)

    @cached_property
    def moe_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.params.experts)


@dataclass(frozen=True)
class ModelFacts:
    cfg: ModelConfig
    layers: tuple[Block, ...]  # the trunk, in order
    embedding: Block
    output: Block
    mtp: Optional[Block]
    expert_count: int  # routed experts per MoE layer
    _stages: dict = field(default_factory=dict, compare=False, repr=False)

    def blocks(self) -> tuple[Block, ...]:
        return (self.embedding, *self.layers, self.output, *((self.mtp,) if self.mtp else ()))

    @property
    def total(self) -> Share:
        return _sum(b.params for b in self.blocks())

    def pipeline_stages(self, pp: int) -> list[PipelineStage]:
        """An even split of the trunk over ``pp`` stages, the first ``num_layers % pp`` one layer longer."""
        if pp not in self._stages:
            L, pattern = len(self.layers), self.cfg.pattern
            base, extra = divmod(L, pp)
            stages, start = [], 0
            for s in range(pp):
                layers = range(start, start + base + (s < extra))
                first, last = s == 0, s == pp - 1
                blocks = (*((self.embedding,) if first else ()), *self.layers[layers.start:layers.stop],
                          *((self.output, *((self.mtp,) if self.mtp else ())) if last else ()))
                mla = tuple(i for i in layers if pattern[i] == "M")
                stages.append(PipelineStage(s, layers, blocks, first, last, mla))
                start = layers.stop
            self._stages[pp] = stages
        return self._stages[pp]


def _sum(shares) -> Share:
    total = Share()
    for s in shares:
        total = total + s
    return total


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """Quintic Newton-Schulz of one rows x cols block: per step X X^T (2 m^2 n), its square (2 m^3)
    and the product with X (2 m^2 n), m the smaller side."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def _fsdp_units(model: nn.Module) -> list[str]:
    """Module names that FSDP wraps as their own unit (`moe_lc.parallel.data_parallel.apply_fsdp`)."""
    moe_prefixes = [name for name, m in model.named_modules() if isinstance(m, LatentMoE)]
    units = []
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            units.append(name)
        elif isinstance(module, (KDAttention, GatedMLA, GatedFFN, LatentMoE)):
            if not any(name.startswith(p + ".") for p in moe_prefixes):
                units.append(name)
    return units


def _block_of(name: str) -> str:
    if name.startswith("layers."):
        return "layer" + name.split(".")[1]
    if name.startswith("mtp."):
        return MTP
    if name.startswith("embed."):
        return EMBEDDING
    return OUTPUT


@lru_cache(maxsize=16)
def _model_facts(cfg_json: str, per_head: bool, ns_steps: int) -> ModelFacts:
    cfg = ModelConfig.from_dict(json.loads(cfg_json))
    model = build_model(cfg, device="meta")
    split = set(tensor_parallel_plan(model))
    roles = {id(p): role for role, p in parameter_roles(model, per_head)}
    experts = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
    units = sorted(_fsdp_units(model), key=len, reverse=True)  # longest (innermost) prefix first

    per_block: dict[str, dict] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        share = Share(experts=n) if id(p) in experts else Share(split=n) if name in split else Share(replicated=n)
        b = per_block.setdefault(_block_of(name), dict(params=Share(), adamw=Share(), units={}, root=Share(),
                                                      ns=NewtonSchulzFlops(), gathered=0.0))
        b["params"] = b["params"] + share
        unit = next((u for u in units if name.startswith(u + ".")), None)
        if unit is None:
            b["root"] = b["root"] + share
        else:
            b["units"][unit] = b["units"].get(unit, Share()) + share
        role = roles[id(p)]
        if not role.muon:
            b["adamw"] = b["adamw"] + share
            continue
        *batch, rows, cols = p.shape
        if id(p) in experts:
            b["ns"] = b["ns"] + NewtonSchulzFlops(experts=batch[0] * newton_schulz_flops(rows, cols, ns_steps))
        elif role.head_dim:
            blocks = (rows if role.head_axis == 0 else cols) // role.head_dim
            shape = (role.head_dim, cols) if role.head_axis == 0 else (rows, role.head_dim)
            b["ns"] = b["ns"] + NewtonSchulzFlops(heads=blocks * newton_schulz_flops(*shape, ns_steps))
        else:
            b["ns"] = b["ns"] + NewtonSchulzFlops(whole=newton_schulz_flops(rows, cols, ns_steps))
            b["gathered"] = max(b["gathered"], float(n))

    def block(label: str) -> Block:
        b = per_block[label]
        return Block(label, b["params"], b["adamw"], tuple(b["units"].values()), b["root"], b["ns"], b["gathered"])

    return ModelFacts(
        cfg,
        tuple(block(f"layer{i}") for i in range(cfg.num_layers)),
        block(EMBEDDING),
        block(OUTPUT),
        block(MTP) if MTP in per_block else None,
        cfg.moe.num_routed,
    )


def model_facts(cfg: ModelConfig, muon_per_head: bool = True, ns_steps: int = 5) -> ModelFacts:
    """The facts of ``cfg`` (cached per config: a meta build of k3 takes a fraction of a second)."""
    return _model_facts(json.dumps(cfg.to_dict(), sort_keys=True), muon_per_head, ns_steps)
