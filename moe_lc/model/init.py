"""Model construction and initialisation (docs/design.md §7.4).

Build on the meta device first (no memory, so `k3` can be planned on a laptop), then
materialise and initialise: normal(std) for projections, output projections scaled by
1/sqrt(2 * num_layers) so that the residual stream's variance does not grow with depth,
KDA A = 0 with a spread of decay time scales, zero AttnRes pseudo-queries, unit norms.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.attn_res import DepthMixer
from moe_lc.model.kda import KDAttention
from moe_lc.model.moe import RoutedExperts
from moe_lc.model.norm import RMSNorm
from moe_lc.model.short_conv import ShortConv
from moe_lc.model.transformer import MoELCModel

_OUTPUT_PROJECTIONS = ("o_proj", "w_out", "latent_up")


@torch.no_grad()
def init_weights(model: MoELCModel, seed: Optional[int] = None) -> MoELCModel:
    cfg = model.cfg
    if seed is not None:
        torch.manual_seed(seed)
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.num_layers)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, out_std if leaf in _OUTPUT_PROJECTIONS else std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, RoutedExperts):
            nn.init.normal_(module.w_gate, 0.0, std)
            nn.init.normal_(module.w_in, 0.0, std)
            nn.init.normal_(module.w_out, 0.0, out_std)
        elif isinstance(module, (RMSNorm, DepthMixer, ShortConv)):
            module.reset_parameters()
        elif isinstance(module, KDAttention):
            module.reset_gate_parameters()
    for module in model.modules():  # balancer biases and other buffers start at zero
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() or buf.dtype in (torch.int32, torch.int64):
                buf.zero_()
    return model


def build_model(
    cfg: ModelConfig, device: Union[str, torch.device] = "cpu", seed: Optional[int] = 0, dtype: torch.dtype = torch.float32
) -> MoELCModel:
    """Construct on meta, then (unless device is meta) materialise on `device` and initialise."""
    with torch.device("meta"):
        model = MoELCModel(cfg)
    if torch.device(device).type == "meta":
        return model
    model = model.to_empty(device=device)
    init_weights(model, seed=seed)
    # Cast parameters only: balancer biases and statistics stay fp32 whatever the compute dtype.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model
