"""The parallel layout: how many ranks each kind of parallelism takes, checked before any collective.

The dense mesh is ``pp x dp_replicate x dp_shard x cp x tp`` (row-major, tp innermost, so
tensor-parallel peers are neighbouring ranks). Expert parallelism does not add ranks: the
``ep`` ranks are folded over the innermost ranks of ``dp_shard x cp x tp``, giving the
expert mesh ``pp x dp_replicate x edp x ep`` with ``edp = dp_shard * cp * tp / ep``
(Megatron's "parallel folding" with expert-tensor-parallel size 1). With ``ep >= tp`` an
expert group holds whole tensor-parallel groups; with ``ep < tp`` it lies inside one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_lc.config import ConfigError, ModelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "edp", "ep")
DP_MODES = ("fsdp", "zero1")
PARAM_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class ParallelLayout:
    """Degrees of each parallelism and the data-parallel flavour.

    dp_mode "fsdp": FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state
    over ``dp_shard`` and replicates over ``dp_replicate`` (HSDP). "zero1": parameters and
    gradients are replicated over all data-parallel ranks, only the optimizer state is
    sharded (see ``moe_lc.parallel.data_parallel``).
    param_dtype: compute dtype of FSDP's unsharded parameters (master weights stay fp32);
    "auto" = bfloat16 on CUDA, float32 on CPU.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    dp_mode: str = "fsdp"
    sequence_parallel: bool = True
    param_dtype: str = "auto"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert shard inside one replicate group."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def expert_mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.edp, self.ep)

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "ParallelLayout":
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown parallel layout field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def __str__(self) -> str:
        dims = " x ".join(f"{n}={getattr(self, n)}" for n in (*MESH_DIMS, "ep") if getattr(self, n) > 1)
        return f"{dims or 'single rank'} ({self.dp_mode})"

    # -- validation ------------------------------------------------------------------
    def validate(self, model_cfg: Optional[ModelConfig] = None, world_size: Optional[int] = None) -> "ParallelLayout":
        """Raise ConfigError naming the numbers and a fix; call before creating any process group."""
        for name in (*MESH_DIMS, "ep"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value >= 1, f"parallel.{name}={value!r} must be a positive integer"
            )
        _require(self.dp_mode in DP_MODES, f"parallel.dp_mode={self.dp_mode!r}: use one of {', '.join(DP_MODES)}")
        _require(
            self.param_dtype in PARAM_DTYPES,
            f"parallel.param_dtype={self.param_dtype!r}: use one of {', '.join(PARAM_DTYPES)}",
        )
        if world_size is not None:
            _require(
                self.world_size == world_size,
                f"the layout pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                f"x cp={self.cp} x tp={self.tp} needs {self.world_size} ranks but the world has {world_size}; "
                f"{_world_fix(self, world_size)}",
            )
        _require(self.pp == 1, f"parallel.pp={self.pp}: pipeline parallelism is not implemented yet; set pp=1")
        _require(self.cp == 1, f"parallel.cp={self.cp}: context parallelism is not implemented yet; set cp=1")
        _require(
            self.sequence_parallel or self.tp == 1,
            f"parallel.tp={self.tp} with sequence_parallel=false: the MoE layers route every token once per "
            "rank, so under tensor parallelism the tokens must be split over the tp ranks; set "
            "sequence_parallel=true",
        )
        folded = self.dp_shard * self.cp * self.tp
        _require(
            folded % self.ep == 0,
            f"parallel.ep={self.ep} must divide dp_shard*cp*tp={self.dp_shard}*{self.cp}*{self.tp}={folded} "
            "(expert parallelism borrows those ranks); raise dp_shard or lower ep",
        )
        _require(
            self.ep % self.tp == 0 or self.tp % self.ep == 0,
            f"parallel.ep={self.ep} and tp={self.tp}: one must divide the other so that expert groups are "
            "made of whole tensor-parallel groups (ep >= tp) or lie inside one (ep < tp)",
        )
        if model_cfg is not None:
            self._validate_model(model_cfg)
        return self

    def _validate_model(self, cfg: ModelConfig) -> None:
        tp, ep = self.tp, self.ep
        m = cfg.moe
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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _world_fix(layout: ParallelLayout, world_size: int) -> str:
    others = layout.pp * layout.dp_replicate * layout.cp * layout.tp
    if world_size % others == 0:
        return f"set dp_shard={world_size // others} (or change the other degrees)"
    return f"choose degrees whose product is {world_size}"
