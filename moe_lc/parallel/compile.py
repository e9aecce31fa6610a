"""Regional ``torch.compile`` (``compile:`` in a recipe): the small elementwise-heavy modules compiled
one by one, applied from outside the model like the other transforms.

Why these and not whole decoder layers: on one H200 at 8K, two thirds of a training step's kernel
time is elementwise work and copies over [tokens, d] fp32 tensors in ~4,000 launches
(docs/performance.md §12.3), while the GEMMs, attention and the KDA kernels are already single
kernels. An RMSNorm in eager mode is about 8 kernels forward and 12 backward (upcast, square, mean,
rsqrt, two products, a cast), and there are several per layer; compiled, it is one or two each way.
The KDA and attention ops take the batch's document bounds as host lists, on which Dynamo would
guard and recompile for every new batch, so the layers themselves stay eager.

Targets (``compile.targets``):

- ``norms``: every RMSNorm of the model (the AttnRes mixers' norms belong to ``attn_res``; KDA's
  gated output norm only where it does not run its fused kernels);
- ``attn_res``: every AttnRes depth mixer (norm of each source, scores, softmax over depth and the
  weighted sum, with its hand-written backward). Where the mixture runs its Triton kernels
  (``attn_res.backend`` auto on CUDA) they are a graph break and this fuses only the PyTorch
  reference (``attn_res.backend=torch``);
- ``float8``: every torchao float8 linear (``precision=fp8``): eager float8 runs its amax, scale and
  cast as separate kernels around each GEMM, which compiling fuses.
- ``moe``: every LatentMoE layer whole: the router, Quantile Balancing's selection and histogram,
  the latent projections, the sort by expert, the gather, the routed and shared experts (their
  grouped GEMMs and the fused SiTU as opaque calls) and the weighted combine: one graph a forward.
  Measured on one H200 (k3-small, 8K), this glue took ~2x its kernel time on the host, in a step
  whose GPU waited for the host 31% of the time; with the experts as graph breaks the layer was
  three graphs, and the GPU's longest waits in the forward were at their entries (docs/performance.md
  §12.22). The step's bf16 copies of the expert weights are made before the graph is entered
  (``RoutedExperts.prepare_step_weights``, eagerly: their backward adds into the fp32 ``.grad``),
  so the graph only reads them. Where the experts' path cannot be traced (``moe.wgrad_backend``
  on Triton, whose backward writes ``.grad`` itself; float8 experts) they stay out of the graph as
  one graph break each. Shapes do not depend on the routing (tokens x top-k rows, sorted on the
  device), so a layer compiles once per sequence length. Left out where expert parallelism
  replaced the dispatch (its all-to-alls stay eager).

Each module is compiled on first call for the shapes it sees (a new sequence length compiles
again, once). Not combined with tensor parallelism yet (the norms would see DTensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

import torch
from torch import nn

from moe_lc.config import ConfigError
from moe_lc.model.attn_res import DepthMixer
from moe_lc.model.moe import LatentMoE
from moe_lc.model.norm import GatedRMSNorm, RMSNorm
from moe_lc.ops.grouped_experts import resolve_wgrad_backend
from moe_lc.parallel.layout import Choice, parse_choice


# Dynamo keeps one compiled graph per code object and guard set: every RMSNorm (or float8 linear)
# of the model shares one forward, and each dtype, rank and width it meets is another entry (the
# proxy's norms meet six; float8 linears see bf16 and fp32 inputs of several widths). Past
# Dynamo's default of 8 the remaining modules silently run eager, as measured with fp8 on an H200.
RECOMPILE_LIMIT = 64


class CompileTarget(Choice):
    norms = "norms"
    attn_res = "attn_res"
    float8 = "float8"
    moe = "moe"


AUTO = "auto"


def _parse_enabled(value: Any) -> bool | str:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    if text == AUTO:
        return AUTO
    raise ConfigError(f"compile.enabled={value!r}: use true, false or auto (on for one process on a CUDA GPU)")


@dataclass
class RegionalCompile:
    """Which modules ``torch.compile`` compiles (``compile:`` in a recipe; off by default).

    ``enabled``: true, false, or auto: on where it was measured to pay, one process on a CUDA GPU
    (1.6x on the proxy at 8K on one H200, docs/performance.md §12); off on a CPU, where Inductor
    compiles C++ for a model that trains in seconds, and on several ranks, where it is not
    measured yet (true turns it on there).
    """

    enabled: Any = False  # true | false | auto (Any: OmegaConf has no bool-or-string type)
    targets: List[str] = field(default_factory=lambda: ["norms", "attn_res", "float8", "moe"])

    def __post_init__(self) -> None:
        self.enabled = _parse_enabled(self.enabled)
        self.targets = [parse_choice(CompileTarget, "compile.targets", t) for t in self.targets]

    def resolve(self, device_type: str, world_size: int, tp: int = 1) -> "RegionalCompile":
        """This policy with ``auto`` decided for the run's device, world size and tp degree."""
        if self.enabled != AUTO:
            return self
        return replace(self, enabled=device_type == "cuda" and world_size == 1 and tp == 1)

    def check(self, tp: int = 1) -> "RegionalCompile":
        if self.enabled is True and tp > 1:
            raise ConfigError(f"compile.enabled=true with layout.tp={tp}: regional compilation is not combined "
                              "with tensor parallelism yet; set compile.enabled=false or layout.tp=1")
        return self


def _is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"  # torchao's; no import where torchao is absent


def compile_targets(model: nn.Module, targets: list, device: Optional[torch.device] = None) -> list[str]:
    """Paths of the modules that ``targets`` select in ``model``, in module order; for a model on
    ``device``, without the gated norms that run one fused kernel there anyway."""
    chosen = set(targets)
    in_mixers = {id(m.norm) for m in model.modules() if isinstance(m, DepthMixer)}
    names = []
    for name, module in model.named_modules():
        if isinstance(module, DepthMixer):
            picked = CompileTarget.attn_res in chosen
        elif isinstance(module, RMSNorm):
            picked = CompileTarget.norms in chosen and id(module) not in in_mixers
            if isinstance(module, GatedRMSNorm) and device is not None and module.fused_on(device):
                picked = False
        elif isinstance(module, LatentMoE):
            picked = CompileTarget.moe in chosen and "routed" not in vars(module)  # EP swaps in its own
        else:
            picked = CompileTarget.float8 in chosen and _is_float8_linear(module)
        if picked:
            names.append(name)
    return names


def apply_compile(model: nn.Module, policy: RegionalCompile, tp: int = 1, world_size: int = 1) -> list[str]:
    """Compile the modules ``policy`` selects in place (``nn.Module.compile``); their paths.
    ``auto`` is decided for the device of the model's parameters, ``world_size`` and ``tp``."""
    policy.check(tp)
    device = next(model.parameters()).device
    policy = policy.resolve(device.type, world_size, tp)
    if not policy.enabled:
        return []
    names = compile_targets(model, policy.targets, device)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, LatentMoE):
            if _experts_traceable(module):
                _compile_whole_moe_layer(module)
                continue
            _keep_experts_out_of_the_graph(module)
        module.compile()
    return names


def _experts_traceable(moe: LatentMoE) -> bool:
    """Whether the routed experts can run inside the layer's graph: not where their backward sums the
    weight gradients into ``.grad`` itself (``wgrad_backend`` on Triton) or runs float8 GEMMs."""
    experts = moe.experts
    device = experts.w_gate.device
    return experts.backend != "float8" and resolve_wgrad_backend(device, experts.wgrad_backend) != "triton"


def _compile_whole_moe_layer(moe: LatentMoE) -> None:
    """One graph for the layer's forward. The step's weight copies (an autograd Function whose
    backward adds into the fp32 ``.grad``, a side effect Dynamo must not trace) are made eagerly
    before the graph, which then only looks them up."""
    # Only the stacked step copies' path runs in the graph; the other (evaluation, fp32 weights, the
    # CPU reference, whose loop reads the counts back) stays eager, one graph break.
    moe.experts.unstacked = torch.compiler.disable(moe.experts.unstacked, recursive=True)
    compiled = torch.compile(moe.forward)

    def forward(x: torch.Tensor) -> torch.Tensor:
        moe.experts.prepare_step_weights(x)
        return compiled(x)

    forward.compiled_region = compiled
    moe.forward = forward


def _keep_experts_out_of_the_graph(moe: LatentMoE) -> None:
    """The routed and shared experts run as they do eagerly inside a compiled MoE layer: one graph
    break each instead of Dynamo tracing into their kernels' launchers."""
    for expert_module in (moe.experts, moe.shared):
        if expert_module is not None:
            expert_module.forward = torch.compiler.disable(expert_module.forward, recursive=True)
    if moe.shared is not None:  # what the layer calls where the shared experts' projection is stacked with its own
        moe.shared.from_gate_in = torch.compiler.disable(moe.shared.from_gate_in, recursive=True)


def compiled_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that ``apply_compile`` compiled (what a run reports)."""
    return [name for name, m in model.named_modules()
            if getattr(m, "_compiled_call_impl", None) is not None or hasattr(vars(m).get("forward"), "compiled_region")]
