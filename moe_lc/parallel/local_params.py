"""Let the unchanged model code compute with rank-local pieces of DTensor parameters.

After tensor/expert parallelism every parameter is a DTensor (so that optimizers, FSDP2
and DCP see its global shape and placement), while the model's forward is plain PyTorch on
local tensors. A forward pre-hook puts each parameter's local tensor in the module's
parameter slot for the duration of the forward, and a forward hook puts the DTensor back.
FSDP2's own hooks run outside these (they are registered first-in, last-out), so under
FSDP the hooks see the unsharded parameter, a DTensor on the tp (or ep) mesh.

Gradient rule: a parameter sharded over a mesh dim receives the exact gradient of its shard.
A parameter replicated over a mesh dim is, in this package, always applied to this rank's
part of the work only (its sequence shard under SP, its heads inside a TP region), so its
local gradient is partial and is summed over that dim (``sum_gradient``).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moe_lc.parallel.comm import sum_gradient

_HOOKED = "_moe_lc_local_param_hooks"


def local_tensor(param: Tensor) -> Tensor:
    """The tensor this rank computes with; autograd carries gradients back to ``param``."""
    if not isinstance(param, DTensor):
        return param
    local = param.to_local()
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate() and mesh.size(dim) > 1:
            local = sum_gradient(local, mesh.get_group(dim))
    return local


def expose_local_parameters(module: nn.Module) -> None:
    """Hook ``module`` so that its direct DTensor parameters read as local tensors inside forward."""
    if getattr(module, _HOOKED, False) or not module._parameters:
        return
    saved: list[dict[str, Tensor]] = []

    def swap_in(mod: nn.Module, args):
        originals = {}
        for name, param in mod._parameters.items():
            if isinstance(param, DTensor):
                originals[name] = param
                mod._parameters[name] = local_tensor(param)
        saved.append(originals)

    def swap_out(mod: nn.Module, args, output):
        mod._parameters.update(saved.pop())
        return output

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)
    setattr(module, _HOOKED, True)


def expose_all_local_parameters(model: nn.Module) -> None:
    for module in model.modules():
        expose_local_parameters(module)
