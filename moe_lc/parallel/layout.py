"""The parallel layout: how many ranks each kind of parallelism takes, checked before any collective.

The dense mesh is ``pp x dp_replicate x dp_shard x cp x tp`` (row-major, tp innermost, so
tensor-parallel peers are neighbouring ranks). Expert parallelism does not add ranks: the
``ep`` ranks are folded over the innermost ranks of ``dp_shard x cp x tp``, giving the
expert mesh ``pp x dp_replicate x edp x ep`` with ``edp = dp_shard * cp * tp / ep``
(Megatron's "parallel folding" with expert-tensor-parallel size 1). With ``ep >= tp`` an
expert group holds whole tensor-parallel groups; with ``ep < tp`` it lies inside one.

``ParallelLayout`` is both what a recipe writes (the trainer's ``layout:`` section, a Hydra
structured config) and what the engine runs: ``resolve(world_size)`` turns the first into
the second, ``validate(model_cfg, seq_len)`` checks it against the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from moe_lc.config import ConfigError, ModelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "edp", "ep")
DEGREES = (*MESH_DIMS, "ep")
FILL = -1  # dp_shard: whatever the other degrees leave of the world


class Choice(str, Enum):
    """A string option of the layout: equal to its value and printed as it (``dp_mode == "fsdp"``).

    Members are named like their values, so that a recipe writes ``dp_mode: zero1`` and
    OmegaConf rejects any other word while the recipe is composed.
    """

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class DPMode(Choice):
    fsdp = "fsdp"  # FSDP2 (HSDP with dp_replicate > 1): parameters, gradients, optimizer state sharded
    zero1 = "zero1"  # parameters and gradients replicated, optimizer state sharded


class PipelineSchedule(Choice):
    """The order in which a pipeline runs its micro-batches (``moe_lc.parallel.pipeline_schedule``)."""

    one_f_one_b = "one_f_one_b"  # 1F1B: one stage per rank
    interleaved_1f1b = "interleaved_1f1b"  # 1F1B over virtual stages (several per rank, round robin)
    interleaved_zero_bubble = "interleaved_zero_bubble"  # ZB1P: virtual stages, split backward
    zbv = "zbv"  # zero bubble, two stages per rank in a V
    dualpipev = "dualpipev"  # DualPipe-V: two stages per rank in a V, forward and backward overlapped


class ParamDType(Choice):
    auto = "auto"  # bfloat16 on CUDA, float32 on CPU
    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclass
class ParallelLayout:
    """Degrees of each parallelism and the data-parallel flavour.

    dp_shard = -1 takes what pp x dp_replicate x cp x tp leave of the world. A layout that
    nothing pins (world_size null and dp_shard -1) fits itself to the world it is resolved for:
    cp and ep are then upper bounds, each lowered to the largest divisor of the asked value
    that the world allows, so one recipe runs on 1, 2 or 8 ranks. Setting world_size (or
    dp_shard) pins the layout: every degree is taken as written and must fit exactly.

    dp_mode "fsdp": FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state
    over ``dp_shard`` and replicates over ``dp_replicate`` (HSDP). "zero1": parameters and
    gradients are replicated over all data-parallel ranks, only the optimizer state is
    sharded (see ``moe_lc.parallel.data_parallel``).
    param_dtype: compute dtype of FSDP's unsharded parameters (master weights stay fp32).
    fsdp_reduce_every_micro_batch: FSDP reduce-scatters each micro-batch's gradients into the
    sharded ones, instead of keeping a whole unsharded fp32 copy of the rank's gradients across a
    step's accumulation and reducing once: that copy's memory saved for (accumulation - 1) more
    reductions per step.

    Pipeline (pp > 1): the decoder layers are cut into pp x stages-per-rank stages of consecutive
    layers; ``pp_schedule`` orders the micro-batches, ``pp_stages_per_rank`` (None: 1 for
    one_f_one_b, 2 otherwise) sets the virtual stages, ``pp_stage_layers`` (None: balanced by
    modelled cost) lists the decoder layers of each stage, e.g. [24, 23, 23, 23].
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = FILL
    cp: int = 1
    tp: int = 1
    ep: int = 1
    dp_mode: DPMode = DPMode.fsdp
    sequence_parallel: bool = True
    param_dtype: ParamDType = ParamDType.auto
    fsdp_reduce_every_micro_batch: bool = False
    world_size: Optional[int] = None  # the rank count this layout is meant for (null: whatever is launched)
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    pp_stages_per_rank: Optional[int] = None  # virtual stages per rank (null: what the schedule needs)
    pp_stage_layers: Optional[list[int]] = None  # decoder layers per stage, in order (null: balanced by cost)
    gpus_per_node: int = field(default=8, compare=False)  # planning: reported as a node count

    def __post_init__(self) -> None:
        # Direct construction (ParallelLayout(dp_mode="zero1")) gets the same choices as a recipe.
        self.dp_mode = parse_choice(DPMode, "layout.dp_mode", self.dp_mode)
        self.param_dtype = parse_choice(ParamDType, "layout.param_dtype", self.param_dtype)
        self.pp_schedule = parse_choice(PipelineSchedule, "layout.pp_schedule", self.pp_schedule)

    # -- resolution ----------------------------------------------------------------------
    @property
    def fits_world(self) -> bool:
        """Nothing pins the layout: cp and ep shrink to what the world allows (see the class doc)."""
        return self.world_size is None and self.dp_shard == FILL

    @property
    def resolved(self) -> bool:
        """Every degree known and multiplying out to world_size (what resolve returns)."""
        return (
            self.world_size is not None
            and self.dp_shard != FILL
            and math.prod(getattr(self, d) for d in MESH_DIMS) == self.world_size
        )

    def check_degrees(self) -> None:
        """Every degree a positive integer (dp_shard may be -1); needs no world and no model."""
        for name in DEGREES:
            value = getattr(self, name)
            fill = " or -1 (fill the world)" if name == "dp_shard" else ""
            _require(
                _positive(value) or (fill and value == FILL), f"layout.{name}={value!r} must be a positive integer{fill}"
            )
        _require(
            self.world_size is None or _positive(self.world_size),
            f"layout.world_size={self.world_size!r} must be a positive integer or null (fit the world)",
        )
        _require(_positive(self.gpus_per_node), f"layout.gpus_per_node={self.gpus_per_node!r} must be a positive integer")
        _require(
            self.pp_stages_per_rank is None or _positive(self.pp_stages_per_rank),
            f"layout.pp_stages_per_rank={self.pp_stages_per_rank!r} must be a positive integer or null (what "
            "the schedule needs)",
        )

    def resolve(self, world_size: int) -> "ParallelLayout":
        """This layout for ``world_size`` ranks, every degree known (``world_size`` set, dp_shard filled)."""
        self.check_degrees()
        _require(isinstance(world_size, int) and world_size >= 1, f"world size {world_size!r} must be a positive integer")
        _require(
            self.world_size is None or self.world_size == world_size,
            f"layout.world_size={self.world_size} but the world has {world_size} rank(s); launch {self.world_size} "
            f"(torchrun --nproc-per-node {self.world_size}) or set layout.world_size=null to fit the layout to the world",
        )
        fixed = self.pp * self.dp_replicate * self.tp
        _require(
            world_size % fixed == 0,
            f"layout.pp*dp_replicate*tp = {self.pp}*{self.dp_replicate}*{self.tp} = {fixed} does not divide the "
            f"world's {world_size} rank(s); lower those degrees or launch a multiple of {fixed} ranks",
        )
        cp = math.gcd(self.cp, world_size // fixed) if self.fits_world else self.cp
        if self.dp_shard == FILL:
            others = fixed * cp
            _require(
                world_size % others == 0,
                f"layout.cp={cp}: pp*dp_replicate*cp*tp = {others} does not divide the world's {world_size} "
                f"rank(s); lower cp or launch a multiple of {others} ranks",
            )
            dp_shard = world_size // others
        else:
            dp_shard = self.dp_shard
            needed = fixed * cp * dp_shard
            _require(
                needed == world_size,
                f"the layout pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x cp={cp} "
                f"x tp={self.tp} needs {needed} ranks but the world has {world_size}; {_world_fix(fixed * cp, world_size)}",
            )
        ep = math.gcd(self.ep, dp_shard * cp * self.tp) if self.fits_world else self.ep
        return dataclasses.replace(self, dp_shard=dp_shard, cp=cp, ep=ep, world_size=world_size)

    # -- validation ------------------------------------------------------------------------
    def validate(
        self, model_cfg: Optional[ModelConfig] = None, seq_len: Optional[int] = None, runnable: bool = True
    ) -> "ParallelLayout":
        """Raise ConfigError naming the field and a fix; call on a resolved layout before any process group.

        runnable=False accepts pipeline schedules this torch lacks, for planning.
        """
        self.check_degrees()
        self._require_resolved("validate")
        _require(
            not self.fsdp_reduce_every_micro_batch or self.dp_mode == DPMode.fsdp,
            "layout.fsdp_reduce_every_micro_batch=true needs dp_mode=fsdp (ZeRO-1 keeps replicated gradients "
            "and reduces them once per step); set it to false or use fsdp",
        )
        _require(
            self.sequence_parallel or self.tp == 1,
            f"layout.tp={self.tp} with sequence_parallel=false: the MoE layers route every token once per "
            "rank, so under tensor parallelism the tokens must be split over the tp ranks; set "
            "sequence_parallel=true",
        )
        folded = self.dp_shard * self.cp * self.tp
        _require(
            folded % self.ep == 0,
            f"layout.ep={self.ep} must divide dp_shard*cp*tp={self.dp_shard}*{self.cp}*{self.tp}={folded} "
            "(expert parallelism borrows those ranks); raise dp_shard or lower ep",
        )
        _require(
            self.ep % self.tp == 0 or self.tp % self.ep == 0,
            f"layout.ep={self.ep} and tp={self.tp}: one must divide the other so that expert groups are "
            "made of whole tensor-parallel groups (ep >= tp) or lie inside one (ep < tp)",
        )
        if seq_len is not None and self.cp > 1:
            _require(
                seq_len % (2 * self.cp) == 0,
                f"layout.cp={self.cp} needs seq_len={seq_len} divisible by 2*cp (load-balanced causal "
                "sharding); change seq_len or cp",
            )
            _require(
                seq_len % (self.cp * self.tp) == 0,
                f"layout.cp={self.cp} x tp={self.tp} needs seq_len={seq_len} divisible by cp*tp (sequence "
                "parallelism splits each rank's seq_len/cp tokens over tp); change seq_len, cp or tp",
            )
        if self.pp > 1:
            self._validate_pipeline(runnable)
        if model_cfg is not None:
            self._validate_model(model_cfg)
        return self

    # -- the pipeline ----------------------------------------------------------------------------
    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds: ``pp_stages_per_rank``, or what the schedule needs."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule == PipelineSchedule.one_f_one_b else 2

    @property
    def pipeline_stages(self) -> int:
        """Stages of consecutive decoder layers the model is cut into (1 without a pipeline)."""
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    def _validate_pipeline(self, runnable: bool) -> None:
        from moe_lc.parallel.pipeline_schedule import check_schedule

        check_schedule(self.pp_schedule, self.stages_per_rank, needs_torch=runnable)

    def _validate_model(self, cfg: ModelConfig) -> None:
        tp, ep = self.tp, self.ep
        m = cfg.moe
        stages = self.pipeline_stages
        _require(
            stages <= cfg.num_layers,
            f"layout.pp={self.pp} x {self.stages_per_rank} stage(s) per rank = {stages} pipeline stages exceed the "
            f"model's {cfg.num_layers} layers (a stage holds at least one); lower pp or pp_stages_per_rank",
        )
        if self.pp > 1 and self.pp_stage_layers is not None:
            counts = list(self.pp_stage_layers)
            _require(
                len(counts) == stages and all(_positive(c) for c in counts) and sum(counts) == cfg.num_layers,
                f"layout.pp_stage_layers={counts} must list {stages} positive layer counts (one per pipeline "
                f"stage) summing to the model's {cfg.num_layers} layers; fix the list or set it to null (balanced)",
            )
        _require(
            m.num_routed % ep == 0,
            f"moe.num_routed={m.num_routed} experts cannot be split over ep={ep} ranks; "
            f"choose ep among the divisors of {m.num_routed}",
        )
        if tp == 1:
            return
        fix = "lower tp or change the model"
        if "K" in cfg.pattern:
            _require(
                cfg.kda.num_heads % tp == 0,
                f"kda.num_heads={cfg.kda.num_heads} is not divisible by tp={tp} (TP splits KDA heads); {fix}",
            )
        _require(
            cfg.mla.num_heads % tp == 0,
            f"mla.num_heads={cfg.mla.num_heads} is not divisible by tp={tp} (TP splits MLA heads); {fix}",
        )
        vocab = cfg.padded_vocab_size
        _require(
            vocab % tp == 0,
            f"padded vocabulary {vocab} (vocab_size={cfg.vocab_size}, vocab_multiple={cfg.vocab_multiple}) is not "
            f"divisible by tp={tp}; set vocab_multiple to a multiple of {tp}",
        )
        _require(
            vocab // tp <= cfg.vocab_size,
            f"padded vocabulary {vocab} over tp={tp} gives {vocab // tp} rows per rank, more than the "
            f"{cfg.vocab_size} real tokens: the last rank would hold only padding; lower tp or vocab_multiple",
        )
        if m.first_dense_layers > 0:
            _require(
                m.dense_hidden % tp == 0,
                f"moe.dense_hidden={m.dense_hidden} is not divisible by tp={tp} (TP splits the dense FFN); {fix}",
            )
        shared_hidden = m.num_shared * m.expert_hidden
        _require(
            shared_hidden % tp == 0,
            f"shared expert hidden num_shared*expert_hidden={m.num_shared}*{m.expert_hidden}={shared_hidden} "
            f"is not divisible by tp={tp} (TP splits the shared experts); {fix}",
        )

    def _require_resolved(self, what: str) -> None:
        _require(
            self.resolved,
            f"{what} needs a resolved layout (dp_shard={self.dp_shard}, world_size={self.world_size}); "
            "call layout.resolve(world_size) first",
        )

    # -- what a resolved layout gives ----------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different samples."""
        self._require_resolved("dp")
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert shard inside one replicate group."""
        self._require_resolved("edp")
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def wraps_with_fsdp(self) -> bool:
        """Whether the model is wrapped by FSDP: dp_mode fsdp over more than one rank (a single process
        trains its module as it is)."""
        return self.dp_mode == "fsdp" and self.world_size > 1

    @property
    def state_shards(self) -> int:
        """Ranks that split parameters/optimizer state (everything but replicas)."""
        self._require_resolved("state_shards")
        return self.world_size // self.dp_replicate

    def mesh_shape(self) -> tuple[int, ...]:
        self._require_resolved("mesh_shape")
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def expert_mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.edp, self.ep)

    def describe(self) -> str:
        """One line for logs and the plan: every degree, the world and the node count."""
        self._require_resolved("describe")
        dims = " ".join(f"{d}={getattr(self, d)}" for d in DEGREES)
        nodes = -(-self.world_size // self.gpus_per_node)
        where = f"world {self.world_size}" + (f", {nodes} nodes" if self.world_size > 1 else "")
        if self.pp > 1:
            where += f"; pipeline {self.pp_schedule}, {self.pipeline_stages} stages"
        return f"{dims} ({where})"

    def lowered_from(self, requested: "ParallelLayout") -> list[str]:
        """The degrees a fitted resolve lowered from what ``requested`` wrote, e.g. ``["cp 8 -> 2"]``."""
        return [
            f"{d} {getattr(requested, d)} -> {getattr(self, d)}" for d in ("cp", "ep") if getattr(requested, d) != getattr(self, d)
        ]

    def as_dict(self) -> dict:
        """JSON-able fields (choices as their strings), e.g. for a checkpoint's trainer state."""
        return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(self).items()}

    def __str__(self) -> str:
        dims = " x ".join(f"{n}={getattr(self, n)}" for n in DEGREES if getattr(self, n) != 1)
        reduce = ", reduce every micro-batch" if self.fsdp_reduce_every_micro_batch else ""
        return f"{dims or 'single rank'} ({self.dp_mode}{reduce})"


def parse_choice(kind: type[Choice], where: str, value: object) -> Choice:
    """``value`` as a member of ``kind``; ConfigError naming the field ``where`` and the choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{where}={value!r}: use one of {', '.join(m.value for m in kind)}") from None


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _world_fix(others: int, world_size: int) -> str:
    if world_size % others == 0:
        return f"set dp_shard={world_size // others} (or -1 to fill the world)"
    return f"choose degrees whose product is {world_size}"
