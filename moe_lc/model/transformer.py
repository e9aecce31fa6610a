"""The hybrid KDA/MLA LatentMoE language model.

Decoder layer = token mixing (KDA or Gated MLA) then channel mixing (LatentMoE, or a dense
SiTU-GLU FFN in the first layers); each sublayer is pre-norm and reads its input from the
residual stream (plain residual or Attention Residuals). No positional encoding anywhere.

Packed documents reach every token mixer as one :class:`DocumentBounds` argument (built where the
batch is uploaded, with the boundaries on the device and on the host), so no layer reads the
device back to find them.

Under context parallelism (``docs.shard`` set) the model runs on this rank's shard of one packed
row: its token mixers exchange what crosses the shard's edges, everything else is token-wise, and
the targets come cut from the whole row's (labels and :func:`mtp_labels`; see
``moe_lc.parallel.context.shard_model_inputs``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.attn_res import DepthMixer, ResidualStream
from moe_lc.model.ffn import GatedFFN
from moe_lc.model.kda import KDAttention
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import LatentMoE
from moe_lc.model.norm import RMSNorm
from moe_lc.model.precision import upcast
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.linear_cross_entropy import linear_cross_entropy
from moe_lc.ops.stacked_linear import plain_tensor

IGNORE_INDEX = -100


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str, use_attn_res: bool) -> None:
        super().__init__()
        self.layer_idx, self.kind = layer_idx, kind
        d, eps = cfg.d_model, cfg.norm_eps
        mixing, fused_norm = cfg.attn_res.backend, cfg.attn_res.fused_norm
        # The very first sublayer sees one source (the embedding): softmax over it is 1, so no mixer.
        self.attn_mixer = DepthMixer(d, eps, mixing, fused_norm) if use_attn_res and layer_idx > 0 else None
        self.attn_norm = RMSNorm(d, eps)
        self.attn = KDAttention(d, cfg.kda, eps) if kind == "K" else GatedMLA(d, cfg.mla, eps)
        self.ffn_mixer = DepthMixer(d, eps, mixing, fused_norm) if use_attn_res else None
        self.ffn_norm = RMSNorm(d, eps)
        m = cfg.moe
        if cfg.is_dense_layer(layer_idx):
            self.ffn = GatedFFN(d, m.dense_hidden, m.activation, m.situ_beta1, m.situ_beta2)
        else:
            self.ffn = LatentMoE(d, m, eps)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, LatentMoE)

    def forward(self, stream: ResidualStream, docs: Optional[DocumentBounds] = None) -> ResidualStream:
        """The stream after both sublayers; a pure function of ``stream`` (which it leaves unchanged),
        so that activation checkpointing can run it again in backward."""
        stream = stream.plus(self.attn(stream.normed_input(self.attn_mixer, self.attn_norm), docs))
        return stream.plus(self.ffn(stream.normed_input(self.ffn_mixer, self.ffn_norm)))


class MultiTokenPrediction(nn.Module):
    """One extra depth that predicts token t+2 from the trunk's state at t and the embedding of t+1.

    Plain residual inside (it is one layer deep); shares the embedding and LM head with the trunk.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, eps = cfg.d_model, cfg.norm_eps
        self.hidden_norm = RMSNorm(d, eps)
        self.embed_norm = RMSNorm(d, eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(cfg, cfg.num_layers, "M", use_attn_res=False)
        self.final_norm = RMSNorm(d, eps)

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor, docs: Optional[DocumentBounds]):
        h = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embed)], dim=-1))
        return self.final_norm(self.layer(ResidualStream.start("none", h), docs).partial)


@dataclass
class ModelOutput:
    loss: Optional[torch.Tensor]  # LM loss (+ MTP loss) (+ auxiliary balance loss)
    lm_loss: Optional[torch.Tensor]
    logits: Optional[torch.Tensor]
    aux_loss: Optional[torch.Tensor] = None
    mtp_loss: Optional[torch.Tensor] = None


def mtp_labels(labels: torch.Tensor, docs: Optional[DocumentBounds] = None) -> torch.Tensor:
    """MTP's targets from the row's labels: labels[t+1] (the token after the next one), ignored where
    labels[t] is (no next token to embed), at the row's last token and at each document's last token
    (never predict across a document boundary). A shift of the whole row: under context parallelism
    label t+1 of a chunk's last token lies in the next chunk, so the caller cuts each rank's targets
    from this (``moe_lc.parallel.context.shard_model_inputs``)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    targets[labels == IGNORE_INDEX] = IGNORE_INDEX
    if docs is not None:  # the boundaries where the labels are: the device's, or the host's for host labels
        bounds = docs.cu_seqlens if docs.cu_seqlens.device == labels.device else torch.tensor(docs.host)
        targets[0, bounds[1:].long() - 1] = IGNORE_INDEX
    return targets


@dataclass(frozen=True)
class HeadLogits:
    """The LM head's logits, not computed: the head's input and weight, which ``MoELCModel.lm_loss``
    takes in place of logits to compute the loss and its gradients chunk by chunk without keeping
    them (``moe_lc.ops.linear_cross_entropy``). Passed through ``lm_loss`` so that whatever wraps the
    method (the profiler's ``moe_lc::loss`` range, ``moe_lc.metrics.breakdown``) sees the loss."""

    hidden: torch.Tensor
    weight: torch.Tensor
    vocab_size: int
    chunk_tokens: int
    backend: str

    def cross_entropy(self, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(self.hidden, self.weight, labels, self.vocab_size, self.chunk_tokens,
                                    backend=self.backend)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32, ignoring IGNORE_INDEX (padding, document tails)."""
    return F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


class MoELCModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.d_model
        use_ar = cfg.attn_res.mode != "none"
        self.embed = nn.Embedding(cfg.padded_vocab_size, d)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kind, use_ar) for i, kind in enumerate(cfg.pattern)
        )
        self.out_mixer = DepthMixer(d, cfg.norm_eps, cfg.attn_res.backend, cfg.attn_res.fused_norm) if use_ar else None
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.padded_vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp else None
        self.mtp_weight = 0.1
        self.loss_chunk_elements = 1 << 28  # logits elements per loss chunk when logits are not returned
        # The loss without logits: the fused head and cross-entropy (HeadLogits) where the head is plain;
        # False (cfg.fused_loss): checkpointed chunks (what tensor parallelism runs), for comparisons.
        self.fused_loss = cfg.fused_loss
        self.loss_backend = cfg.loss_backend  # the fused loss's elementwise part (ModelConfig.loss_backend)

    def moe_layers(self) -> list[LatentMoE]:
        mods = [layer.ffn for layer in self.layers if layer.is_moe]
        if self.mtp is not None and self.mtp.layer.is_moe:
            mods.append(self.mtp.layer.ffn)
        return mods

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)[..., : self.cfg.vocab_size]

    def lm_loss(self, logits: Union[torch.Tensor, HeadLogits], labels: torch.Tensor) -> torch.Tensor:
        """Token cross-entropy of the LM head's logits, or of ``HeadLogits`` (the fused path);
        vocab-parallel TP swaps in its own (moe_lc.parallel)."""
        if isinstance(logits, HeadLogits):
            return logits.cross_entropy(labels)
        return language_model_loss(logits, labels)

    def loss_chunk_tokens(self) -> int:
        """Tokens per loss chunk: logits of at most ~``loss_chunk_elements`` (padded vocabulary) each."""
        return max(1, self.loss_chunk_elements // self.cfg.padded_vocab_size)

    def fuses_head_and_loss(self) -> bool:
        """Whether the loss skips the logits (``HeadLogits``): ``fused_loss`` is on, the head is a plain
        ``nn.Linear`` without bias over a plain tensor (not tensor parallelism's vocab-parallel head
        over a DTensor, nor a torchao ``Float8Linear``) and ``lm_loss`` is this class's own."""
        head = self.lm_head
        return (self.fused_loss and type(head) is nn.Linear and head.bias is None
                and plain_tensor(head.weight) and self._loss_is_own())

    def _loss_is_own(self) -> bool:
        """``lm_loss`` is the method, or a function set on the instance around it (the profiler's
        ``component_ranges`` wraps it so), not a loss object put in its place (TP's ``VocabParallelLoss``)."""
        fn = self.lm_loss
        if inspect.ismethod(fn):
            return fn.__self__ is self and fn.__func__ is MoELCModel.lm_loss
        return inspect.isfunction(fn)

    def head_output(self, h: torch.Tensor) -> Union[torch.Tensor, HeadLogits]:
        """What ``lm_loss`` takes for the final hidden states ``h``: ``HeadLogits`` where the loss is fused
        (``fuses_head_and_loss``), else the logits."""
        if not self.fuses_head_and_loss():
            return self.logits_from_hidden(h)
        return HeadLogits(h, self.lm_head.weight, self.cfg.vocab_size, self.loss_chunk_tokens(), self.loss_backend)

    def chunked_lm_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The LM loss without holding [tokens, vocab] logits at once (long-context training).

        Fused (``fuses_head_and_loss``): each chunk's logits, loss and gradients are computed once in
        the forward and only the gradients of h and W are kept (``moe_lc.ops.linear_cross_entropy``).
        Else tokens are cut into chunks whose logits stay under ~`loss_chunk_elements`; each chunk's
        logits are recomputed in backward (activation checkpointing), so the peak is one chunk.
        Either is equal to `lm_loss(logits_from_hidden(h), labels)` up to summation order.
        """
        if self.fuses_head_and_loss():
            return self.lm_loss(self.head_output(h), labels)
        tokens = h.shape[0] * h.shape[1]
        per_chunk = self.loss_chunk_tokens()
        if tokens <= per_chunk:
            return self.lm_loss(self.logits_from_hidden(h), labels)
        h_flat, y_flat = h.reshape(1, tokens, -1), labels.reshape(1, tokens)
        valid = (y_flat != IGNORE_INDEX).sum()
        total = h.new_zeros((), dtype=torch.float32)
        for start in range(0, tokens, per_chunk):
            h_c, y_c = h_flat[:, start : start + per_chunk], y_flat[:, start : start + per_chunk]
            n_c = (y_c != IGNORE_INDEX).sum()
            chunk_loss = torch.utils.checkpoint.checkpoint(
                lambda hc, yc: self.lm_loss(self.logits_from_hidden(hc), yc), h_c, y_c, use_reentrant=False
            )
            total = total + torch.where(n_c > 0, chunk_loss * n_c, torch.zeros_like(chunk_loss))
        return total / valid.clamp_min(1)

    def start_stream(self, input_ids: torch.Tensor) -> ResidualStream:
        """The residual stream before the first decoder layer: the token embedding, in autocast's
        dtype where autocast is on (unless ``fp32_embedding``): the stream's other sources are
        sublayer outputs in that dtype, and one fp32 source would make every mixture fp32."""
        embedding = self.embed(input_ids)
        device_type = embedding.device.type
        if not self.cfg.fp32_embedding and torch.is_autocast_enabled(device_type):
            embedding = embedding.to(torch.get_autocast_dtype(device_type))
        return ResidualStream.start(self.cfg.attn_res.mode, embedding)

    def run_layers(self, stream: ResidualStream, layers, docs: Optional[DocumentBounds]) -> ResidualStream:
        """The stream after ``layers`` (consecutive decoder layers), each closing its block when it ends one."""
        for layer in layers:
            stream = layer(stream, docs).end_layer(layer.layer_idx, self.cfg.attn_res.block_size)
        return stream

    def head_input(self, stream: ResidualStream) -> torch.Tensor:
        """The final normalised hidden states from the stream after the last decoder layer."""
        return stream.normed_input(self.out_mixer, self.final_norm)

    def hidden_states(self, input_ids: torch.Tensor, docs: Optional[DocumentBounds] = None) -> torch.Tensor:
        """Final normalised hidden states [B, T, d]."""
        _check_documents(input_ids, docs)
        return self.head_input(self.run_layers(self.start_stream(input_ids), self.layers, docs))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        docs: Optional[DocumentBounds] = None,
        return_logits: bool = True,
        mtp_targets: Optional[torch.Tensor] = None,
    ) -> ModelOutput:
        """input_ids/labels: [B, T] (labels already shifted: labels[t] is the target after input t).

        ``docs``: the packed documents of the row (B must be 1), e.g.
        ``DocumentBounds.from_host(cu_seqlens, device)``; None: every row is one sequence.
        ``mtp_targets``: the MTP layer's targets (:func:`mtp_labels` of the row), by default made from
        ``labels``; needed under context parallelism, where this rank's labels lack the next chunk's."""
        _check_mtp_targets(self.mtp is not None and labels is not None, labels, mtp_targets, docs)
        h = self.hidden_states(input_ids, docs)
        if labels is None:
            return ModelOutput(loss=None, lm_loss=None, logits=self.logits_from_hidden(h))
        return self.objective(h, labels, docs, return_logits, self.moe_layers(), mtp_targets)

    def objective(
        self,
        h: torch.Tensor,
        labels: torch.Tensor,
        docs: Optional[DocumentBounds],
        return_logits: bool,
        moe_layers: list[LatentMoE],
        mtp_targets: Optional[torch.Tensor] = None,
    ) -> ModelOutput:
        """The training objective from the final hidden states ``h``: the LM loss, the MTP loss and the
        auxiliary balance loss of ``moe_layers`` (the layers whose forward this objective closes);
        ``mtp_targets`` as in :meth:`forward`."""
        logits = self.logits_from_hidden(h) if return_logits else None
        lm_loss = self.lm_loss(logits, labels) if logits is not None else self.chunked_lm_loss(h, labels)
        loss = lm_loss
        mtp_loss = None
        if self.mtp is not None:
            targets = mtp_targets if mtp_targets is not None else mtp_labels(labels, docs)
            mtp_loss = self._mtp_loss(h, labels, docs, targets)
            loss = loss + self.mtp_weight * mtp_loss
        aux_loss = balance_loss(moe_layers)
        if aux_loss is not None:
            loss = loss + aux_loss
        return ModelOutput(loss=loss, lm_loss=lm_loss, logits=logits, aux_loss=aux_loss, mtp_loss=mtp_loss)

    def _mtp_loss(self, h: torch.Tensor, labels: torch.Tensor, docs: Optional[DocumentBounds],
                  targets: torch.Tensor) -> torch.Tensor:
        """Predict labels[t+1] (``targets``, :func:`mtp_labels`) from h[t] and embed(labels[t]) (the token at t+1)."""
        next_tok = labels.clamp_min(0)
        mtp_h = self.mtp(h, self.embed(next_tok), docs)
        return self.lm_loss(self.head_output(mtp_h), targets)


def balance_loss(moe_layers: list[LatentMoE]) -> Optional[torch.Tensor]:
    """The auxiliary balance losses the layers' last forward left (``moe.balancing=aux``), summed; else None."""
    aux = [m.aux_loss for m in moe_layers if m.aux_loss is not None]
    return torch.stack(aux).sum() if aux else None


def _check_documents(input_ids: torch.Tensor, docs: Optional[DocumentBounds]) -> None:
    """One clear error for packed documents that do not fit the batch (no device read)."""
    if docs is None:
        return
    if not isinstance(docs, DocumentBounds):
        raise TypeError(f"MoELCModel: docs must be DocumentBounds, got {type(docs).__name__}; wrap boundaries with "
                        "DocumentBounds.from_host(cu_seqlens, device) (host) or DocumentBounds.of(cu_seqlens) (device)")
    if docs.shard is not None:
        local = docs.shard.context.local_len
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] != local:
            raise ValueError(f"MoELCModel: under context parallelism input_ids must be this rank's shard [1, {local}] "
                             f"of the row of {docs.total} tokens, got {tuple(input_ids.shape)}; cut it with "
                             "moe_lc.parallel.context.shard_model_inputs")
        return
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or docs.total != input_ids.shape[1]:
        raise ValueError(f"MoELCModel: packed documents (docs) need input_ids [1, T] with T = the last boundary "
                         f"{docs.total}, got {tuple(input_ids.shape)}; pack the rows into one")


def _check_mtp_targets(use_mtp: bool, labels: Optional[torch.Tensor], targets: Optional[torch.Tensor],
                       docs: Optional[DocumentBounds]) -> None:
    """MTP's targets fit the labels; under context parallelism they must be given (no device read)."""
    if not use_mtp:
        return
    if targets is None:
        if docs is not None and docs.shard is not None:
            raise ValueError("MoELCModel: under context parallelism the MTP layer needs mtp_targets, this rank's shard "
                             "of mtp_labels(row labels, docs) (the next chunk's labels are on another rank); "
                             "moe_lc.parallel.context.shard_model_inputs cuts it")
        return
    if targets.shape != labels.shape:
        raise ValueError(f"MoELCModel: mtp_targets {tuple(targets.shape)} must have the labels' shape "
                         f"{tuple(labels.shape)}; pass this rank's shard of mtp_labels(row labels, docs)")
