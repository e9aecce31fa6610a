"""Activation checkpointing, applied from outside the model: what each decoder layer keeps for backward.

    none        autograd keeps everything the layers save (fastest, most memory)
    selective   per decoder layer: keep the outputs of the expensive ops (matmuls, grouped expert
                GEMMs, attention, the KDA recurrence), recompute the cheap elementwise work in backward
                (norms, activations, gates, AttnRes mixing, routing and dispatch)
    full        keep only each decoder layer's inputs (the residual stream); recompute the layer
    every: n    only every n-th layer (0-based indices n-1, 2n-1, ...; the MTP layer counts as the
                last) is checkpointed, the others keep everything
    offload     what the layers still save for backward goes to pinned host memory during the forward
                and is copied back when backward needs it
    kda_states  the fused KDA kernels keep every chunk's state (bf16, 768 bytes per head and token at
                K = V = 128) for the backward, which then skips its state pass: speed for memory
    kda_prep    the fused KDA kernels keep every output of their prep (W, U, Gamma Q, Gamma_C K in bf16,
                G in fp32: 1,544 bytes per head and token at K = V = 128) for the backward, which then
                skips recomputing them: speed for memory

A checkpointed layer is `torch.utils.checkpoint` (non-reentrant) around the layer's forward, which
is a pure function of the residual stream it is given. Selective mode adds an op policy
(`create_selective_checkpoint_contexts`) that saves the outputs of matmul and attention ops; the KDA
recurrence runs Triton kernels that an op policy cannot see, so its call (`KDAttention.recurrence`)
is kept explicitly: it runs once, outside the policy's bookkeeping, its own saved tensors stay, and
the recompute reuses its output. While a layer recomputes, the MoE balancers do not count the
tokens again (`ExpertBalancer.select` accumulates only in training mode) and the layer's
auxiliary-loss attribute keeps the forward's value.

The model draws no random numbers in its forward, so no RNG state is stashed for the recompute.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moe_lc.config import ConfigError
from moe_lc.model.kda import KDAttention
from moe_lc.model.moe import LatentMoE
from moe_lc.model.transformer import DecoderLayer, MoELCModel
from moe_lc.parallel.layout import Choice, parse_choice


class CheckpointMode(Choice):
    none = "none"  # keep everything
    selective = "selective"  # keep matmul / attention / KDA outputs, recompute elementwise work
    full = "full"  # keep each layer's inputs only


@dataclass
class ActivationCheckpointing:
    """The activation checkpointing policy of a run or a stage (``activation_checkpointing:`` in a recipe)."""

    mode: CheckpointMode = CheckpointMode.none
    every: int = 1  # checkpoint every n-th decoder layer (1: all of them)
    offload: bool = False  # saved activations to pinned host memory between forward and backward
    kda_states: bool = False  # the fused KDA keeps its per-chunk states for backward (no state pass there)
    kda_prep: bool = False  # the fused KDA keeps every prep output for backward (no prep rerun there)

    def __post_init__(self) -> None:
        self.mode = parse_choice(CheckpointMode, "activation_checkpointing.mode", self.mode)

    def check(self) -> "ActivationCheckpointing":
        """Raise ConfigError naming the field and the fix; returns self."""
        if not (isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 1):
            raise ConfigError(f"activation_checkpointing.every={self.every!r} must be a positive integer (1: every layer)")
        for name in ("kda_states", "kda_prep"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"activation_checkpointing.{name}={getattr(self, name)!r} must be true or false")
        if self.offload and self.mode == CheckpointMode.full and self.every == 1:
            raise ConfigError("activation_checkpointing.offload with mode full and every 1 moves nothing (a full "
                              "checkpoint keeps only each layer's inputs); use mode none or selective, or every > 1")
        return self

    def checkpoints(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (0-based; the MTP layer is num_layers) is checkpointed."""
        return self.mode != CheckpointMode.none and (layer_idx + 1) % self.every == 0

    def describe(self) -> str:
        every = f" every {self.every}" if self.every > 1 and self.mode != CheckpointMode.none else ""
        return (f"{self.mode}{every}{' + offload' if self.offload else ''}{' + kda states' if self.kda_states else ''}"
                f"{' + kda prep' if self.kda_prep else ''}")


def _ops(*names: str) -> frozenset:
    """The aten overloads of these names that this PyTorch build has."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return frozenset(found)


# Ops whose outputs selective checkpointing keeps: matrix products (the routed experts' too) and attention.
SAVED_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
) | frozenset(op for op in [getattr(torch.ops.higher_order, "flex_attention", None)] if op is not None) | frozenset(
    [torch.ops.moe_lc.grouped_glu_stacked.default])  # the routed experts' GEMMs and SiTU, one custom op


def offload_saved_tensors() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep saved activations in (pinned) host memory until backward.

    Unlike ``torch.autograd.graph.save_on_cpu`` they leave parameters (and views of them) where
    they are, since those are kept anyway, and keep each tensor's strides, so that the backward
    runs the same kernels on the same layouts as without offloading.
    """

    def pack(t: Tensor) -> Any:
        root = t if t._base is None else t._base
        if root.is_leaf and root.requires_grad:
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        return t.device, host

    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Region:
    """One call of a checkpointed layer: the kept calls' outputs, recorded in forward and replayed
    in the recompute, and the state the recompute must not disturb."""

    def __init__(self, moe_layers: list[LatentMoE], offload: bool) -> None:
        self.moe_layers = moe_layers
        self.offload = offload
        self.policy_mode: Optional[Any] = None  # the op policy's forward dispatch mode (selective)
        self.outputs: list[Any] = []
        self.replaying = False
        self.replayed = 0

    def keep_hooks(self) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks for a kept call: its tensors stay (or go to host memory), not recomputed."""
        if self.offload:
            return offload_saved_tensors()
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


class _Phase:
    """The forward or the recompute of one region: marks it current for the kept calls and enters
    ``inner`` (the op policy's dispatch mode, when selective)."""

    def __init__(self, slot: "_LayerSlot", region: _Region, replay: bool, inner: Optional[Any]) -> None:
        self.slot, self.region, self.replay, self.inner = slot, region, replay, inner

    def __enter__(self) -> "_Phase":
        self.previous = self.slot.region
        self.slot.region = self.region
        self.region.replaying = self.replay
        if self.replay:
            self.region.replayed = 0
            self._paused = [(m, m.balancer.training, m.aux_loss) for m in self.region.moe_layers]
            for moe, _, _ in self._paused:
                moe.balancer.train(False)  # count each token once per step: no statistics while recomputing
        if self.inner is not None:
            self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.inner is not None:
                self.inner.__exit__(*exc)
        finally:
            if self.replay:
                for moe, training, aux in self._paused:
                    moe.balancer.train(training)
                    moe.aux_loss = aux  # the loss used the forward's; do not hold the recompute's graph
            self.slot.region = self.previous


class _LayerSlot:
    """Which region of one layer is running (None outside a checkpointed call)."""

    def __init__(self) -> None:
        self.region: Optional[_Region] = None


class _KeptCall:
    """A layer method whose result a selective checkpoint keeps (installed as an instance attribute)."""

    def __init__(self, method: Callable, slot: _LayerSlot) -> None:
        self.method, self.slot = method, slot

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = self.slot.region
        if region is None:  # not inside a checkpointed call (no grad, or another caller)
            return self.method(*args, **kwargs)
        if region.replaying:
            if region.replayed >= len(region.outputs):
                raise RuntimeError("activation checkpointing: a kept call ran more often in the recompute than in "
                                   "the forward; the layer's forward must be deterministic")
            out = region.outputs[region.replayed]
            region.replayed += 1
            return out
        if _get_current_dispatch_mode() is not region.policy_mode:
            raise RuntimeError("activation checkpointing: a dispatch mode was entered inside a checkpointed layer; "
                               "the kept KDA call cannot step out of the op policy")
        with _pop_mode_temporarily(), region.keep_hooks():
            out = self.method(*args, **kwargs)
        # The recompute gets the same values off the graph, still marked as requiring grad, so that
        # the ops after it save the same tensors as in the forward (checkpoint matches them by count).
        region.outputs.append(tree_map_only(Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), out))
        return out


class _CheckpointedLayer:
    """The forward of one decoder layer under a policy (installed as ``layer.forward``)."""

    def __init__(self, layer: DecoderLayer, checkpointed: bool, selective: bool, offload: bool) -> None:
        self.forward = type(layer).forward.__get__(layer)  # the model's own forward
        self.checkpointed, self.selective, self.offload = checkpointed, selective, offload
        self.moe_layers = [m for m in layer.modules() if isinstance(m, LatentMoE)]
        self.slot = _LayerSlot()
        if checkpointed and selective:
            for module in layer.modules():
                if isinstance(module, KDAttention):
                    module.recurrence = _KeptCall(type(module).recurrence.__get__(module), self.slot)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        if not self.checkpointed:  # offload only
            with offload_saved_tensors():
                return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=self._contexts, **kwargs)

    def _contexts(self) -> tuple[_Phase, _Phase]:
        region = _Region(self.moe_layers, self.offload)
        record, replay = create_selective_checkpoint_contexts(_save_expensive_ops) if self.selective else (None, None)
        region.policy_mode = record
        return _Phase(self.slot, region, False, record), _Phase(self.slot, region, True, replay)


def decoder_layers(model: MoELCModel) -> list[DecoderLayer]:
    """The trunk's decoder layers and the MTP layer, in order."""
    layers = list(model.layers)
    if model.mtp is not None:
        layers.append(model.mtp.layer)
    return layers


def apply_activation_checkpointing(model: MoELCModel, policy: ActivationCheckpointing) -> MoELCModel:
    """Put ``policy`` on the model's decoder layers in place (replacing any earlier policy) and return it.

    Parameters, their names and the state dict are untouched, so this can change between
    curriculum stages without rebuilding the model. Apply after tensor and expert parallelism and
    before or after FSDP (no FSDP unit is a decoder layer); ``parallelize`` does it before FSDP.
    """
    policy.check()
    for layer in decoder_layers(model):
        layer.__dict__.pop("forward", None)
        for module in layer.modules():
            module.__dict__.pop("recurrence", None)
            if isinstance(module, KDAttention):
                module.keep_states = policy.kda_states
                module.keep_prep = policy.kda_prep
        checkpointed = policy.checkpoints(layer.layer_idx)
        if checkpointed or policy.offload:
            layer.forward = _CheckpointedLayer(layer, checkpointed, policy.mode == CheckpointMode.selective,
                                               policy.offload)
    model.moe_lc_activation_checkpointing = policy
    return model


def activation_checkpointing_of(model: nn.Module) -> ActivationCheckpointing:
    """The policy applied to ``model`` (none when nothing was applied)."""
    return getattr(model, "moe_lc_activation_checkpointing", None) or ActivationCheckpointing()
