"""The model's formulas in plain float64 PyTorch, written from docs/model.md and the module
docstrings, for the reference tests.

Nothing here calls moe_lc: every function is its formula written out (the KDA recurrence token by
token with explicit transition matrices, attention as a masked softmax over an explicit document
mask, routing as a dense weight matrix over all experts), so a test that compares a module with it
fails when the module's math changes. Weights are read from the modules as plain tensors: the same
leaves, so autograd through a reference gives gradients with respect to the module's parameters.

One row of tokens at a time: activations are [T, ...]; ``bounds`` are the document boundaries of a
packed row as a list of ints (0, ..., T), or None for a row that is one document.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

# Constants the documentation fixes; a test fails when the code uses others.
SITU_BETA1 = 4.0
SITU_BETA2 = 25.0
L2_NORM_EPS = 1e-6
MTP_WEIGHT = 0.1
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- elementwise
def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: Tensor) -> Tensor:
    return x * sigmoid(x)


def softplus(x: Tensor) -> Tensor:
    return torch.log1p(torch.exp(x))


def softmax(x: Tensor, dim: int) -> Tensor:
    """exp(x) / sum exp(x), shifted by the maximum; -inf entries get weight 0."""
    e = torch.exp(x - x.amax(dim, keepdim=True).detach())
    return e / e.sum(dim, keepdim=True)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def l2_norm(x: Tensor, eps: float = L2_NORM_EPS) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def situ(a: Tensor, c: Tensor, beta1: float = SITU_BETA1, beta2: float = SITU_BETA2) -> Tensor:
    """[b1 tanh(a/b1) sigmoid(a)] [b2 tanh(c/b2)]."""
    return (beta1 * torch.tanh(a / beta1) * sigmoid(a)) * (beta2 * torch.tanh(c / beta2))


def swiglu(a: Tensor, c: Tensor) -> Tensor:
    return silu(a) * c


def glu(x: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor, activation: str,
        beta1: float = SITU_BETA1, beta2: float = SITU_BETA2) -> Tensor:
    """W_out act(W_gate x, W_in x) with weights stored [out, in] as in nn.Linear."""
    a, c = x @ w_gate.T, x @ w_in.T
    h = situ(a, c, beta1, beta2) if activation == "situ" else swiglu(a, c)
    return h @ w_out.T


# ----------------------------------------------------------------------------- documents
def segments(bounds: Optional[Sequence[int]], seq_len: int) -> list[tuple[int, int]]:
    """(start, end) of every document of a row."""
    if bounds is None:
        return [(0, seq_len)]
    return [(int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]


def document_causal_mask(bounds: Optional[Sequence[int]], seq_len: int) -> Tensor:
    """[T, T] bool: query t may see key s iff s <= t and both lie in the same document."""
    allowed = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for s, e in segments(bounds, seq_len):
        allowed[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    return allowed


# ----------------------------------------------------------------------------- KDA
def causal_conv(x: Tensor, weight: Tensor, bounds: Optional[Sequence[int]]) -> Tensor:
    """y[t, c] = sum_{j < W} weight[c, W-1-j] x[t-j, c]; taps before the document start read zero. x: [T, C]."""
    width = weight.shape[1]
    pieces = []
    for s, e in segments(bounds, x.shape[0]):
        xd, n = x[s:e], e - s
        y = xd * weight[:, width - 1]
        for j in range(1, min(width, n)):
            shifted = torch.cat([xd.new_zeros(j, xd.shape[1]), xd[: n - j]])
            y = y + shifted * weight[:, width - 1 - j]
        pieces.append(y)
    return torch.cat(pieces)


def bounded_gate(z: Tensor, a_log: Tensor, g_min: float) -> Tensor:
    """g = g_min sigmoid(exp(A_h) z) per head h; z: [T, H, K] (the decay bias already added)."""
    return g_min * sigmoid(torch.exp(a_log)[:, None] * z)


def softplus_gate(z: Tensor, a_log: Tensor) -> Tensor:
    """g = -exp(A_h) softplus(z)."""
    return -torch.exp(a_log)[:, None] * softplus(z)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
               bounds: Optional[Sequence[int]]) -> Tensor:
    """Token by token, per head: S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T,
    o_t = scale S_t^T q_t, S = 0 at every document start. q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]."""
    heads, key_dim = q.shape[1:]
    eye = torch.eye(key_dim, dtype=q.dtype)
    outputs = []
    for s, e in segments(bounds, q.shape[0]):
        state = q.new_zeros(heads, key_dim, v.shape[-1])
        for t in range(s, e):
            b = beta[t][:, None, None]
            outer_kk = k[t][:, :, None] * k[t][:, None, :]
            transition = (eye - b * outer_kk) @ torch.diag_embed(torch.exp(g[t]))
            state = transition @ state + b * k[t][:, :, None] * v[t][:, None, :]
            outputs.append(scale * torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outputs)


def kda_layer(m, x: Tensor, bounds: Optional[Sequence[int]], eps: float) -> Tensor:
    """The KDA token mixer (moe_lc.model.kda) on one row x [T, d]:
    q, k = L2(SiLU(conv(W x))), v = SiLU(conv(W_v x)), beta = sigmoid(W_b x), g = gate(W_up W_down x + b),
    y = W_o [sigmoid(W_g x) * RMSNorm_head(KDA(q, k, v, g, beta))] with scale head_dim^-1/2."""
    cfg = m.cfg
    T, heads, key_dim = x.shape[0], cfg.num_heads, cfg.head_dim

    def branch(proj, conv):
        return silu(causal_conv(x @ proj.weight.T, conv.weight, bounds)).reshape(T, heads, key_dim)

    q, k, v = l2_norm(branch(m.q_proj, m.q_conv)), l2_norm(branch(m.k_proj, m.k_conv)), branch(m.v_proj, m.v_conv)
    beta = sigmoid(x @ m.beta_proj.weight.T)
    z = (x @ m.decay_down.weight.T @ m.decay_up.weight.T).reshape(T, heads, key_dim) + m.dt_bias.reshape(heads, key_dim)
    g = bounded_gate(z, m.A_log, cfg.g_min) if cfg.gate == "bounded" else softplus_gate(z, m.A_log)
    o = rms_norm(delta_rule(q, k, v, g, beta, key_dim**-0.5, bounds), m.o_norm.weight, eps)
    gate_logits = x
    for linear in m.gate_proj:  # full rank: one matrix; low rank: down then up
        gate_logits = gate_logits @ linear.weight.T
    gated = sigmoid(gate_logits).reshape(T, heads, key_dim) * o
    return gated.reshape(T, heads * key_dim) @ m.o_proj.weight.T


# ----------------------------------------------------------------------------- Gated MLA
def mla_layer(m, x: Tensor, bounds: Optional[Sequence[int]], eps: float) -> Tensor:
    """Gated MLA without positions (moe_lc.model.mla) on one row x [T, d]. Per head, q = [q_nope | q_shared]
    and kv_up gives [k_nope | v]; the shared key W_ks x is one vector per token seen by every head;
    softmax((q_nope.k_nope + q_shared.k_shared) / sqrt(nope + shared)) over earlier keys of the document."""
    c = m.cfg
    T, heads, nope, shared = x.shape[0], c.num_heads, c.qk_nope_dim, c.qk_rope_dim
    if c.q_lora_rank is not None:
        q = rms_norm(x @ m.q_down.weight.T, m.q_norm.weight, eps) @ m.q_up.weight.T
    else:
        q = x @ m.q_proj.weight.T
    q = q.reshape(T, heads, nope + shared)
    kv = (rms_norm(x @ m.kv_down.weight.T, m.kv_norm.weight, eps) @ m.kv_up.weight.T).reshape(T, heads, nope + c.v_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = torch.einsum("thd,shd->hts", q[..., :nope], k_nope)
    if shared > 0:
        k_shared = x @ m.k_shared.weight.T  # [T, shared]
        scores = scores + torch.einsum("thd,sd->hts", q[..., nope:], k_shared)
    scores = scores / math.sqrt(nope + shared)
    scores = scores.masked_fill(~document_causal_mask(bounds, T), float("-inf"))
    o = torch.einsum("hts,shd->thd", softmax(scores, -1), v).reshape(T, heads * c.v_dim)
    if c.gate:
        o = sigmoid(x @ m.gate_proj.weight.T) * o
    return o @ m.o_proj.weight.T


# ----------------------------------------------------------------------------- AttnRes
def depth_mixture(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """sum_i a_i v_i with a = softmax_i(w . RMSNorm(v_i)); one source is its own mixture."""
    if len(sources) == 1:
        return sources[0]
    logits = torch.stack([(rms_norm(v, norm_weight, eps) * query).sum(-1) for v in sources])
    weights = softmax(logits, 0)
    return sum(weights[i][..., None] * v for i, v in enumerate(sources))


class DepthSources:
    """The residual sources of Attention Residuals, by their definition: the embedding, one source per
    completed block of ``block_size`` decoder layers (the sum of its sublayer outputs), and the current
    block's partial sum; mode "full" makes every sublayer output a source; "none" is the plain residual."""

    def __init__(self, mode: str, block_size: int, embedding: Tensor) -> None:
        self.mode, self.block_size = mode, block_size
        self.completed, self.block = [embedding], []  # block: this block's sublayer outputs so far
        self.residual = embedding

    def current(self) -> list[Tensor]:
        return self.completed + ([sum(self.block)] if self.block else [])

    def input(self, query: Optional[Tensor], norm_weight: Optional[Tensor], eps: float) -> Tensor:
        if self.mode == "none":
            return self.residual
        sources = self.current()
        return sources[0] if len(sources) == 1 else depth_mixture(sources, query, norm_weight, eps)

    def add(self, output: Tensor) -> None:
        if self.mode == "none":
            self.residual = self.residual + output
        elif self.mode == "full":
            self.completed.append(output)
        else:
            self.block.append(output)

    def layer_done(self, layer_idx: int) -> None:
        """Decoder layer ``layer_idx`` (0-based) finished: a block closes when the next layer is in another one."""
        if self.mode == "block" and (layer_idx + 1) // self.block_size != layer_idx // self.block_size:
            self.completed.append(sum(self.block))
            self.block = []


# ----------------------------------------------------------------------------- LatentMoE
def top_k_with_margin(biased: Tensor, k: int) -> tuple[Tensor, float]:
    """Indices of the k largest biased scores per token and the smallest gap between the k-th and the
    (k+1)-th (a test needs it well above rounding for the selection to be unambiguous)."""
    biased = biased.detach()
    order = biased.argsort(-1, descending=True)
    ranked = biased.gather(-1, order)
    return order[:, :k], float((ranked[:, k - 1] - ranked[:, k]).min())


def routing_weights(scores: Tensor, chosen: Tensor, routing_scale: float) -> Tensor:
    """[N, n] dense weights: p_j = scale s_j / sum_{r in T} s_r for the chosen experts j, 0 elsewhere."""
    mask = torch.zeros_like(scores).scatter(1, chosen, 1.0)
    picked = scores * mask
    return routing_scale * picked / picked.sum(-1, keepdim=True)


def latent_moe(m, x: Tensor, eps: float, margin: float = 1e-6) -> Tensor:
    """Stable LatentMoE (moe_lc.model.moe) on tokens x [N, d] with the balancer's current bias b:
    s = sigmoid(W_r x), T = top_k(s + b), u = sum_{j in T} p_j E_j(W_down x),
    y = W_up RMSNorm(u) + sum_s E_s^shared(x); without a latent space the experts read x and y = u + shared."""
    c = m.cfg
    scores = sigmoid(x @ m.router.weight.T)
    chosen, gap = top_k_with_margin(scores + m.balancer.bias.to(scores.dtype), c.top_k)
    assert gap > margin, f"a near tie in the routing (gap {gap:.2e}): pick another seed"
    p = routing_weights(scores, chosen, c.routing_scale)
    z = x @ m.latent_down.weight.T if c.latent_dim is not None else x
    e = m.experts
    betas = (c.situ_beta1, c.situ_beta2)
    expert_out = torch.stack([glu(z, e.w_gate[j], e.w_in[j], e.w_out[j], c.activation, *betas)
                              for j in range(c.num_routed)])  # [n, N, width]
    u = torch.einsum("nj,jnl->nl", p, expert_out)
    y = rms_norm(u, m.latent_norm.weight, eps) @ m.latent_up.weight.T if c.latent_dim is not None else u
    h = c.expert_hidden
    for s in range(c.num_shared):  # N_s shared experts of hidden h, stored side by side
        f = m.shared
        rows = slice(s * h, (s + 1) * h)
        y = y + glu(x, f.w_gate.weight[rows], f.w_in.weight[rows], f.w_out.weight[:, rows], c.activation, *betas)
    return y


def routed_experts(m, x: Tensor) -> Tensor:
    """The experts each token is sent to (the selection of :func:`latent_moe`)."""
    scores = sigmoid(x @ m.router.weight.T)
    return top_k_with_margin(scores + m.balancer.bias.to(scores.dtype), m.cfg.top_k)[0]


# ----------------------------------------------------------------------------- the model
def channel_mixer(layer, x: Tensor, cfg, dense: bool) -> Tensor:
    """The dense SiTU-GLU FFN of the first layers, LatentMoE elsewhere."""
    ffn, moe = layer.ffn, cfg.moe
    assert dense == (not hasattr(ffn, "router")), "dense FFN / MoE in the wrong layers"
    if not dense:
        return latent_moe(ffn, x, cfg.norm_eps)
    return glu(x, ffn.w_gate.weight, ffn.w_in.weight, ffn.w_out.weight, moe.activation, moe.situ_beta1,
               moe.situ_beta2)


def decoder_layer(layer, kind: str, sources: DepthSources, bounds, cfg, dense: bool) -> None:
    """One decoder layer: pre-norm token mixing (KDA "K" or MLA "M"), then pre-norm channel mixing."""
    eps = cfg.norm_eps
    token_mixer = kda_layer if kind == "K" else mla_layer
    mixer = layer.attn_mixer
    h = sources.input(None if mixer is None else mixer.query, None if mixer is None else mixer.norm.weight, eps)
    sources.add(token_mixer(layer.attn, rms_norm(h, layer.attn_norm.weight, eps), bounds, eps))
    mixer = layer.ffn_mixer
    h = sources.input(None if mixer is None else mixer.query, None if mixer is None else mixer.norm.weight, eps)
    sources.add(channel_mixer(layer, rms_norm(h, layer.ffn_norm.weight, eps), cfg, dense))


def hidden_states(model, ids: Tensor, bounds: Optional[Sequence[int]]) -> Tensor:
    """Final normalised hidden states [T, d] of one row ids [T]."""
    cfg = model.cfg
    eps = cfg.norm_eps
    sources = DepthSources(cfg.attn_res.mode, cfg.attn_res.block_size, model.embed.weight[ids])
    for i, kind in enumerate(cfg.pattern):
        dense = i < cfg.moe.first_dense_layers
        decoder_layer(model.layers[i], kind, sources, bounds, cfg, dense)
        sources.layer_done(i)
    out = model.out_mixer
    final = sources.input(None if out is None else out.query, None if out is None else out.norm.weight, eps)
    return rms_norm(final, model.final_norm.weight, eps)


def logits(model, h: Tensor) -> Tensor:
    """The LM head over the real vocabulary (padding rows of the head are never scored)."""
    return h @ model.lm_head.weight[: model.cfg.vocab_size].T


def mtp_targets(labels: Tensor, bounds: Optional[Sequence[int]]) -> Tensor:
    """The token two ahead of each input, inside its document: labels[t] is the token after input t,
    so the MTP target of t is labels[t + 1] while t + 1 is in t's document; IGNORE_INDEX otherwise."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    for s, e in segments(bounds, labels.shape[0]):
        for t in range(s, e - 1):
            if labels[t] != IGNORE_INDEX:
                targets[t] = labels[t + 1]
    return targets


def mtp_hidden(model, h: Tensor, next_ids: Tensor, bounds: Optional[Sequence[int]]) -> Tensor:
    """The MTP depth: W [RMSNorm(h_t); RMSNorm(embed(token t+1))], one plain-residual MLA + FFN layer, norm."""
    eps, mtp = model.cfg.norm_eps, model.mtp
    x = torch.cat([rms_norm(h, mtp.hidden_norm.weight, eps), rms_norm(model.embed.weight[next_ids], mtp.embed_norm.weight, eps)], -1)
    sources = DepthSources("none", 1, x @ mtp.proj.weight.T)
    # the MTP layer comes after the last decoder layer: never one of the first, dense ones
    decoder_layer(mtp.layer, "M", sources, bounds, model.cfg, dense=False)
    return rms_norm(sources.residual, mtp.final_norm.weight, eps)


def negative_log_likelihoods(scores: Tensor, targets: Tensor) -> Tensor:
    """-log softmax(scores)[target] for every position whose target is not IGNORE_INDEX."""
    valid = targets != IGNORE_INDEX
    s = scores[valid]
    shift = s.amax(-1, keepdim=True).detach()
    log_z = torch.log(torch.exp(s - shift).sum(-1)) + shift[:, 0]
    return log_z - s.gather(-1, targets[valid][:, None])[:, 0]


def model_losses(model, rows: Sequence[tuple[Tensor, Tensor, Optional[Sequence[int]]]]) -> dict[str, Tensor]:
    """The model's objective over rows of (input ids [T], labels [T], bounds): LM loss = mean NLL over every
    label token of every row (token weighted, not a mean of row means); MTP the same over the MTP targets;
    loss = LM + 0.1 MTP. The MTP reads the embedding of token t+1 = labels[t]; where that is IGNORE_INDEX any
    token will do (nothing scored depends on it)."""
    lm, mtp = [], []
    for ids, labels, bounds in rows:
        h = hidden_states(model, ids, bounds)
        lm.append(negative_log_likelihoods(logits(model, h), labels))
        if model.mtp is not None:
            next_ids = torch.where(labels == IGNORE_INDEX, model.cfg.vocab_size - 1, labels)
            mtp_h = mtp_hidden(model, h, next_ids, bounds)
            mtp.append(negative_log_likelihoods(logits(model, mtp_h), mtp_targets(labels, bounds)))
    out = {"lm_loss": torch.cat(lm).mean()}
    out["loss"] = out["lm_loss"]
    if mtp:
        out["mtp_loss"] = torch.cat(mtp).mean()
        out["loss"] = out["lm_loss"] + MTP_WEIGHT * out["mtp_loss"]
    return out
