"""FP8 training of the dense linears (``precision=fp8``), applied from outside the model with torchao.

The run computes in bf16 as under ``precision=auto``; the linears chosen here run their three GEMMs
(forward, input gradient, weight gradient) in float8 (e4m3) with scales computed from the tensors
on the fly, as torchao's ``Float8Linear`` does. Weights, gradients and optimizer state stay in
their usual precision, so a checkpoint does not know whether it was trained in FP8.

Which linears (``float8_linear_names``; a name is a module path in the model):

- **FP8**: the token mixers' projections (KDA q, k, v, o; MLA q/kv down and up, o), the dense
  FFN, the shared experts, the latent projections of LatentMoE and MTP's input projection: the
  bulk of the dense FLOPs, with wide inputs whose values a per-tensor or per-row scale captures.
- **kept in bf16**, by role:
  ``router`` (its logits decide the expert choice: an FP8 rounding flips top-k selections, and it
  is O(d x experts) work); ``lm_head`` (logits over the vocabulary feed the loss directly; the
  usual choice in FP8 recipes); KDA's ``beta_proj``, ``decay_down`` / ``decay_up`` (the update
  strength and the decay's low-rank path: the decay is exponentiated and compounded over the
  sequence, so its error grows with context) and ``gate_proj`` (output gates of KDA and MLA);
  MLA's ``k_shared`` (the shared key, a narrow d -> qk_rope_dim projection). Norms, the
  embedding and KDA's state recurrence are not linears and stay as they are.
- **shape**: float8 GEMMs need both dimensions divisible by 16; any other linear stays bf16.
- **routed experts** are grouped GEMMs over stacked weights (``moe_lc.ops.grouped_experts``), not
  linears: bf16 by default; ``float8.experts=true`` runs their three grouped GEMMs through torchao's
  row-wise float8 grouped GEMM (``moe_lc.ops.grouped_experts_float8``; compute capability 9.0+,
  expert dimensions divisible by 16; torchao ships it as a prototype, so it is opt-in).

Tensor parallelism is not combined with FP8 yet (a per-tensor scale over a shard is not the full
tensor's); FSDP2 and ZeRO-1, EP, activation checkpointing and pipelines are (the conversion comes
before checkpointing and FSDP; the scales are computed on the all-gathered weight).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moe_lc.config import ConfigError
from moe_lc.parallel.layout import Choice, parse_choice

FP8_DIM_MULTIPLE = 16  # float8 matmuls need both dimensions divisible by 16
BF16_ROLES = ("router", "lm_head", "beta_proj", "decay_down", "decay_up", "gate_proj", "k_shared")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer


class Float8Scaling(Choice):
    tensorwise = "tensorwise"  # one scale per tensor (fastest; the FSDP all-gather can move float8)
    rowwise = "rowwise"  # one scale per row of each operand (more accurate with outliers)


@dataclass
class Float8Training:
    """How ``precision=fp8`` runs (``float8:`` in a recipe)."""

    scaling: Float8Scaling = Float8Scaling.tensorwise
    fsdp_float8_all_gather: bool = False  # FSDP all-gathers the weights already cast to float8 (tensorwise)
    experts: bool = False  # the routed experts' grouped GEMMs in float8 too (row-wise; opt-in, see above)

    def __post_init__(self) -> None:
        self.scaling = parse_choice(Float8Scaling, "float8.scaling", self.scaling)

    def check(self) -> "Float8Training":
        if self.fsdp_float8_all_gather and self.scaling != Float8Scaling.tensorwise:
            raise ConfigError(f"float8.fsdp_float8_all_gather=true needs float8.scaling=tensorwise (got "
                              f"{self.scaling}): a row-wise scale is computed per GEMM, after the gather")
        return self


def _role(name: str) -> str:
    """The last part of a module path that is not a number (``layers.0.attn.gate_proj.0`` -> gate_proj)."""
    return next(part for part in reversed(name.split(".")) if not part.isdigit())


def runs_in_float8(name: str, module: nn.Module) -> bool:
    """Whether the linear at ``name`` is converted (see the module docstring for the rules)."""
    if not isinstance(module, nn.Linear) or _role(name) in BF16_ROLES:
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def float8_linear_names(model: nn.Module) -> list[str]:
    """The module paths of the linears ``apply_float8`` converts, in model order."""
    return [name for name, module in model.named_modules() if runs_in_float8(name, module)]


def _torchao():
    try:
        from torchao import float8
    except ImportError as err:
        raise ConfigError("precision=fp8 needs torchao (pip install torchao, or pip install 'moe-lc[fp8]'); "
                          f"it did not import: {err}") from None
    return float8


def check_float8_device(device_type: str, capability: tuple[int, int] | None = None) -> None:
    """One clear line when this device has no FP8 GEMMs (``capability``: the CUDA device's)."""
    if device_type != "cuda":
        raise ConfigError(f"precision=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+, e.g. "
                          f"H100/H200); this run is on {device_type}: use precision=auto or bf16")
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(f"precision=fp8 needs compute capability 8.9+ (FP8 tensor cores); this GPU has "
                          f"{capability[0]}.{capability[1]}: use precision=auto or bf16")


def apply_float8(model: nn.Module, policy: Float8Training, tp: int = 1) -> list[str]:
    """Swap the chosen linears of ``model`` for torchao ``Float8Linear`` in place (same parameters, same
    names, so state dicts and checkpoints are unchanged); returns the converted module paths."""
    if tp > 1:
        raise ConfigError(f"precision=fp8 with layout.tp={tp} is not implemented yet (a per-tensor scale over a "
                          "tensor-parallel shard is not the whole weight's); use tp=1 with fsdp/zero1, ep or pp, "
                          "or precision=auto")
    policy.check()
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(str(policy.scaling))
    if policy.fsdp_float8_all_gather:
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    names = float8_linear_names(model)
    chosen = set(names)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    if policy.experts:
        experts = float8_expert_names(model)
        for name in experts:
            model.get_submodule(name).backend = "float8"
        names = names + experts
    return names


def float8_expert_names(model: nn.Module) -> list[str]:
    """The module paths of the routed experts whose grouped GEMMs ``float8.experts=true`` converts."""
    from moe_lc.model.moe import RoutedExperts

    return [name for name, module in model.named_modules() if isinstance(module, RoutedExperts)
            and module.w_gate.shape[1] % FP8_DIM_MULTIPLE == 0 and module.w_gate.shape[2] % FP8_DIM_MULTIPLE == 0]
