"""Formula-level mutants of the model: each one changes one piece of math in the code the way a
plausible mistake would. ``tests/mutation/mutate.py`` applies them one at a time to a copy of the
repository and runs the fast model/ops tests; every mutant must be killed (some test fails).

``original`` must occur exactly once in ``path`` (tests/test_mutants.py checks it on every run), so
the list follows the code: when a snippet changes, update its mutant here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    original: str
    replacement: str
    breaks: str  # what the mutant gets wrong, in words


NORM = "moe_lc/model/norm.py"
FFN = "moe_lc/model/ffn.py"
KDA = "moe_lc/model/kda.py"
KDA_OP = "moe_lc/ops/kda.py"
KDA_PROJ = "moe_lc/ops/kda_projections.py"
CONV = "moe_lc/ops/short_conv.py"
MLA = "moe_lc/model/mla.py"
RES = "moe_lc/model/attn_res.py"
MIXTURE = "moe_lc/ops/depth_mixture.py"
MOE = "moe_lc/model/moe.py"
BAL = "moe_lc/model/balancing.py"
MODEL = "moe_lc/model/transformer.py"
CONFIG = "moe_lc/config.py"
INIT = "moe_lc/model/init.py"
PACKING = "moe_lc/data/packing.py"
ACCOUNTING = "moe_lc/model/accounting.py"
SITU = "moe_lc/ops/situ_glu.py"
GROUPED = "moe_lc/ops/grouped_experts.py"
SITU_KERNEL = "kernels/situ_glu_triton.py"
PERMUTATION = "moe_lc/ops/token_permutation.py"
PERMUTATION_KERNEL = "kernels/token_permutation_triton.py"
ROUTER_KERNEL = "kernels/routing_triton.py"
ROUTING = "moe_lc/ops/routing.py"
CONV_KERNEL = "kernels/short_conv_triton.py"
ACCUMULATE_KERNEL = "kernels/accumulate_triton.py"
MIXTURE_KERNELS = "kernels/depth_mixture.py"
MIXTURE_KERNEL = "kernels/depth_mixture_triton.py"
ATTENTION = "moe_lc/ops/attention.py"
FUSED_LOSS = "moe_lc/ops/linear_cross_entropy.py"

MUTANTS: tuple[Mutant, ...] = (
    # -- normalisations
    Mutant("rmsnorm-eps-dropped", NORM, "mean(-1, keepdim=True) + self.eps)", "mean(-1, keepdim=True))",
           "RMSNorm without its eps"),
    Mutant("rmsnorm-eps-changed", NORM, "mean(-1, keepdim=True) + self.eps)", "mean(-1, keepdim=True) + 1e-5)",
           "RMSNorm eps 1e-5 instead of the configured 1e-6"),
    Mutant("rmsnorm-weight-dropped", NORM, "return y * upcast(self.weight)", "return y",
           "RMSNorm ignores its learned weight"),
    Mutant("rmsnorm-sum-not-mean", NORM, "xf.pow(2).mean(-1", "xf.pow(2).sum(-1", "RMSNorm divides by the norm, not the RMS"),
    Mutant("l2norm-eps-changed", KDA_PROJ, "L2NORM_EPS = 1e-6", "L2NORM_EPS = 1e-4", "L2 norm of q/k with eps 1e-4"),
    Mutant("l2norm-k-dropped", KDA_PROJ, "chunk_kda(l2_normalize(q), l2_normalize(k), v,", "chunk_kda(l2_normalize(q), k, v,",
           "KDA keys not L2-normalised"),
    Mutant("kda-o-norm-dropped", KDA, "o = self.o_norm(self.recurrence(q, k, v, z, beta_logits, docs), gate_logits)",
           "o = torch.sigmoid(gate_logits) * self.recurrence(q, k, v, z, beta_logits, docs)", "KDA output without the per-head RMSNorm"),
    Mutant("mla-q-norm-dropped", MLA, "self.q_up(self.q_norm(self.q_down(x)))", "self.q_up(self.q_down(x))",
           "MLA low-rank q without its RMSNorm"),
    Mutant("mla-kv-norm-dropped", MLA, "latents = [self.kv_norm(self.kv_down(x))]", "latents = [self.kv_down(x)]",
           "MLA latent kv without its RMSNorm"),
    Mutant("moe-latent-norm-dropped", MOE, "self.latent_up(self.latent_norm(self.routed(z, topk_idx, weights)))",
           "self.latent_up(self.routed(z, topk_idx, weights))",
           "LatentMoE up-projects u without its RMSNorm"),
    Mutant("pre-norm-dropped", MODEL, "self.attn(self.attn_norm(h), docs)", "self.attn(h, docs)",
           "token mixer reads the residual without its pre-norm"),
    Mutant("final-norm-dropped", MODEL, "return self.final_norm(stream.final(self.out_mixer))",
           "return stream.final(self.out_mixer)", "LM head reads the un-normalised output"),
    Mutant("mtp-hidden-norm-dropped", MODEL, "torch.cat([self.hidden_norm(hidden),", "torch.cat([hidden,",
           "MTP concatenates the trunk state without its RMSNorm"),
    Mutant("attnres-norm-dropped", MIXTURE, "            u, r = _normalised(v, eps)\n",
           "            u, r = v.to(wide), torch.ones(*v.shape[:-1], 1, dtype=wide)\n",
           "AttnRes scores the raw sources, not RMSNorm(v)"),
    # -- scales and activations
    Mutant("mla-scale-nope-only", MLA, "self.scale = cfg.qk_dim**-0.5", "self.scale = cfg.qk_nope_dim**-0.5",
           "softmax scale ignores the shared-key dims"),
    Mutant("mla-scale-dropped", MLA, "self.scale = cfg.qk_dim**-0.5", "self.scale = 1.0", "softmax without 1/sqrt(d)"),
    Mutant("kda-scale-dropped", KDA_PROJ, "scale = q.shape[-1] ** -0.5 if scale is None else scale",
           "scale = 1.0 if scale is None else scale", "KDA output without head_dim^-1/2"),
    Mutant("situ-betas-swapped", SITU, "return (beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)) * (beta2 * torch.tanh(c / beta2))",
           "return (beta2 * torch.tanh(a / beta2) * torch.sigmoid(a)) * (beta1 * torch.tanh(c / beta1))",
           "SiTU with b1 and b2 exchanged"),
    Mutant("situ-default-betas-swapped", CONFIG, "situ_beta1: float = 4.0\n    situ_beta2: float = 25.0",
           "situ_beta1: float = 25.0\n    situ_beta2: float = 4.0", "the configured SiTU constants exchanged"),
    Mutant("situ-beta2-changed", CONFIG, "situ_beta2: float = 25.0", "situ_beta2: float = 20.0", "SiTU b2 = 20"),
    Mutant("situ-sigmoid-dropped", SITU, "torch.tanh(a / beta1) * torch.sigmoid(a))", "torch.tanh(a / beta1))",
           "SiTU gate factor without sigmoid(a)"),
    Mutant("ffn-gate-and-in-swapped", FFN, "a, c = self.w_gate(x), self.w_in(x)",
           "a, c = self.w_in(x), self.w_gate(x)", "GatedFFN's two GEMMs: gates with W_in and scales with W_gate"),
    Mutant("ffn-stacked-gate-and-in-swapped", FFN, "return [self.w_gate.weight, self.w_in.weight]",
           "return [self.w_in.weight, self.w_gate.weight]",
           "GatedFFN's stacked GEMM: gates with W_in and scales with W_gate"),
    Mutant("expert-gate-and-in-swapped", GROUPED, "act(xe @ w_gate[e].t(), xe @ w_in[e].t())",
           "act(xe @ w_in[e].t(), xe @ w_gate[e].t())", "routed experts' gate and input exchanged"),
    Mutant("swiglu-sigmoid-not-silu", SITU, "return F.silu(a) * c", "return torch.sigmoid(a) * c",
           "SwiGLU with sigmoid(a) instead of SiLU(a)"),
    # -- routing
    Mutant("router-softmax", MOE, "scores = torch.sigmoid(upcast(logits))",
           "scores = torch.softmax(upcast(logits), dim=-1)", "softmax router instead of sigmoid"),
    Mutant("router-not-fp32", MOE, "scores = torch.sigmoid(upcast(logits))",
           "scores = torch.sigmoid(logits)", "router scores in the activation dtype (bf16)"),
    Mutant("weights-not-normalised", ROUTING, "return picked / picked.sum(-1, keepdim=True) * scale",
           "return picked * scale", "routing weights are the raw scores"),
    Mutant("weights-mixed-with-bias", MOE, "weights = routing_weights(scores, topk_idx,",
           "weights = routing_weights(scores + self.balancer.bias, topk_idx,", "the balancing bias leaks into the weights"),
    Mutant("routing-scale-dropped", ROUTING, "picked.sum(-1, keepdim=True) * scale", "picked.sum(-1, keepdim=True)",
           "routing weights without routing_scale"),
    Mutant("topk-without-bias", BAL, "topk_idx = (upcast(scores.detach()) + self.bias).topk(",
           "topk_idx = upcast(scores.detach()).topk(", "selection on scores alone (no balancing bias)"),
    Mutant("topk-without-bias-while-balancing", BAL, "biased = upcast(scores.detach()) + upcast(bias.detach())",
           "biased = upcast(scores.detach())", "QB routes on scores alone while it accumulates statistics"),
    Mutant("routed-weights-dropped", PERMUTATION, "(upcast(by_slot).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)",
           "upcast(by_slot).view(tokens, k, -1).sum(1)", "expert outputs summed without their weights"),
    Mutant("shared-expert-dropped", MOE, "y = y + self.shared.from_gate_in(shared_gate_in)", "y = y",
           "shared experts (stacked into the layer's input GEMM) not added"),
    Mutant("combine-kernel-weights-dropped", PERMUTATION_KERNEL, "x = x * tl.load(weights + t * K + s).to(tl.float32)",
           "x = x", "the Triton combine sums the experts' rows without their weights"),
    Mutant("router-kernel-sigmoid-derivative-dropped", ROUTER_KERNEL, "dx = ds * s * (1.0 - s)", "dx = ds * s",
           "the fused router's backward misses the sigmoid's derivative factor (1 - s)"),
    Mutant("router-kernel-cutoff-is-the-last-score", ROUTER_KERNEL, "alpha = tl.max(remaining, axis=1)",
           "alpha = tl.min(remaining, axis=1)", "the fused router's cutoff is the lowest score, not the (k+1)-th"),
    Mutant("sort-kernel-earlier-blocks-dropped", PERMUTATION_KERNEL, "within + (starts + earlier)[None, :]",
           "within + starts[None, :]", "the counting sort forgets the expert's slots in earlier blocks"),
    Mutant("dense-layers-off-by-one", CONFIG, "return layer_idx < self.moe.first_dense_layers",
           "return layer_idx <= self.moe.first_dense_layers", "one dense FFN layer too many"),
    # -- KDA
    Mutant("gate-bound-doubled", KDA, "lower = self.cfg.g_min if", "lower = 2 * self.cfg.g_min if",
           "bounded gate floor 2 g_min"),
    Mutant("gate-bound-default-changed", CONFIG, "g_min: float = -5.0", "g_min: float = -4.0", "g_min = -4 instead of -5"),
    Mutant("gate-rate-dropped", KDA_OP, "fraction = torch.sigmoid(rate * x)", "fraction = torch.sigmoid(x)",
           "bounded gate ignores exp(A)"),
    Mutant("gate-bias-dropped", KDA_OP, "x = x + dt_bias.to(compute).reshape(heads, key_dim)", "x = x",
           "decay logit without its bias b"),
    Mutant("softplus-gate-rate-dropped", KDA_OP, "return -rate * F.softplus(x)", "return -F.softplus(x)",
           "softplus gate ignores exp(A)"),
    Mutant("beta-sigmoid-dropped", KDA_PROJ, "torch.sigmoid(wide), scale=scale", "wide, scale=scale",
           "beta is the raw logit, not sigmoid(logit)"),
    Mutant("kda-output-gate-sigmoid-dropped", NORM, "self.normalised(x) * torch.sigmoid(upcast(gate))",
           "self.normalised(x) * upcast(gate)", "KDA output gate without sigmoid"),
    Mutant("kda-qkv-silu-dropped", KDA, 'conv = dict(activation="silu", backend=self.conv_backend())',
           "conv = dict(activation=None, backend=self.conv_backend())", "q, k, v without SiLU after the conv"),
    Mutant("conv-window-short", CONV, "    for j in range(1, W):\n", "    for j in range(1, W - 1):\n",
           "short conv drops its oldest tap"),
    Mutant("conv-not-causal", CONV, "shifted = F.pad(x[:, : T - j], (0, 0, j, 0))", "shifted = F.pad(x[:, j:], (0, 0, 0, j))",
           "short conv reads future tokens"),
    Mutant("conv-taps-reversed", CONV, "y = y + shifted * valid * weight[:, W - 1 - j]", "y = y + shifted * valid * weight[:, j - 1]",
           "short conv applies its taps in the wrong order"),
    Mutant("conv-no-document-restart", CONV, "valid = (pos >= j).to(x.dtype).view(1, T, 1)",
           "valid = (pos >= 0).to(x.dtype).view(1, T, 1)", "short conv reads across document starts"),
    Mutant("kda-state-no-document-restart", KDA_PROJ, "output_final_state=output_final_state, docs=docs,",
           "output_final_state=output_final_state, docs=None,",
           "KDA state carried across document starts"),
    Mutant("kda-recurrence-no-decay", KDA_OP, "state = g[:, t].exp()[..., None] * state", "state = state",
           "reference recurrence without the decay"),
    # -- Gated MLA
    Mutant("mla-documents-ignored", ATTENTION, "    if bounds is None:\n        return F.scaled_dot_product_attention(",
           "    if True:\n        return F.scaled_dot_product_attention(", "attention across document boundaries"),
    Mutant("mla-not-causal-in-documents", ATTENTION,
           "v.transpose(1, 2), is_causal=True,\n                                         scale=scale).transpose(1, 2)",
           "v.transpose(1, 2), is_causal=False,\n                                         scale=scale).transpose(1, 2)",
           "attention to later tokens of the document"),
    Mutant("mla-shared-key-dropped", MLA, "k = torch.cat([k_nope, shared_key[0].unsqueeze(2).expand(B, S, H, c.qk_rope_dim)], dim=-1)",
           "k = torch.cat([k_nope, torch.zeros_like(shared_key[0]).unsqueeze(2).expand(B, S, H, c.qk_rope_dim)], dim=-1)",
           "the shared key slot never reaches the scores"),
    Mutant("mla-gate-sigmoid-dropped", MLA, "o = torch.sigmoid(self.gate_proj(x)) * o",
           "o = self.gate_proj(x) * o", "MLA output gate without sigmoid"),
    # -- Attention Residuals
    Mutant("attnres-gradient-sum-never-handed-over", MIXTURE_KERNELS, "elif total is None or ctx.hands_over[i]:",
           "elif total is None:", "the first reader keeps the summed gradient of its source instead of handing it over"),
    Mutant("attnres-gradient-sum-not-added", MIXTURE_KERNEL, "if (ADD_TO >> i) & 1:", "if (ADD_TO >> i) & 0:",
           "a reader overwrites the gradient sum of its source instead of adding its share"),
    Mutant("attnres-gradient-sum-every-reader-first", MIXTURE_KERNELS, "first = not self.claimed", "first = True",
           "every reader hands over what the sum holds so far"),
    Mutant("attnres-block-off-by-one", RES, "(layer_idx + 1) % block_size == 0", "layer_idx % block_size == 0",
           "blocks close one layer early"),
    Mutant("attnres-query-sign", MIXTURE, "logits.append((u * g * q).sum(-1))", "logits.append((u * g * -q).sum(-1))",
           "pseudo-query with the wrong sign"),
    Mutant("attnres-softmax-over-tokens", MIXTURE, "a = torch.softmax(torch.stack(logits), dim=0)",
           "a = torch.softmax(torch.stack(logits), dim=-1)",
           "softmax over tokens instead of over depth"),
    Mutant("attnres-partial-left-out", RES, "return [*self.sources, *([self.partial] if self.partial is not None else [])]",
           "return list(self.sources) if self.sources else [self.partial]", "the current block's partial sum is not a source"),
    Mutant("attnres-output-mixer-dropped", RES, "        return self.sublayer_input(mixer)\n",
           "        return self.all_sources()[-1]\n", "the final output is the last source, not the output mixture"),
    # -- losses and targets
    Mutant("mtp-target-not-shifted", MODEL, "targets[:, :-1] = labels[:, 1:]", "targets[:, :] = labels",
           "MTP predicts t+1 (the LM target) instead of t+2"),
    Mutant("mtp-document-ends-kept", MODEL, "targets[0, bounds[1:].long() - 1] = IGNORE_INDEX", "pass",
           "MTP targets cross document boundaries"),
    Mutant("mtp-weight-changed", MODEL, "self.mtp_weight = 0.1", "self.mtp_weight = 0.3", "MTP loss weight 0.3"),
    Mutant("lm-loss-shifted-again", MODEL, "lm_loss = self.lm_loss(logits, labels) if logits is not None",
           "lm_loss = self.lm_loss(logits[:, :-1], labels[:, 1:]) if logits is not None",
           "the model shifts labels that the data already shifted"),
    Mutant("label-shift-in-packing", PACKING, "labels[: len(tokens) - 1] = tokens[1:]", "labels[:n_real] = tokens[:n_real]",
           "labels are the inputs themselves, not the next tokens"),
    Mutant("ignored-labels-scored", MODEL, "labels.reshape(-1), ignore_index=IGNORE_INDEX)",
           "labels.reshape(-1).clamp_min(0), ignore_index=IGNORE_INDEX)", "IGNORE_INDEX positions scored as token 0"),
    Mutant("loss-mean-over-all-positions", MODEL, "labels.reshape(-1), ignore_index=IGNORE_INDEX)",
           "labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction=\"sum\") / labels.numel()",
           "LM loss divided by every position, not by the label tokens"),
    Mutant("chunked-loss-weighted-by-chunk-size", MODEL, "chunk_loss * n_c, torch.zeros_like(chunk_loss)",
           "chunk_loss * h_c.shape[1], torch.zeros_like(chunk_loss)", "chunks weighted by their size, not their label tokens"),
    Mutant("logits-not-sliced", MODEL, "return self.lm_head(h)[..., : self.cfg.vocab_size]", "return self.lm_head(h)",
           "softmax over the vocabulary's padding rows"),
    Mutant("fused-loss-over-padding-rows", MODEL,
           "HeadLogits(h, self.lm_head.weight, self.cfg.vocab_size,", "HeadLogits(h, self.lm_head.weight, self.cfg.padded_vocab_size,",
           "the fused loss's softmax over the vocabulary's padding rows"),
    Mutant("fused-loss-ignored-rows-get-gradient", FUSED_LOSS,
           "grad = torch.where(valid.unsqueeze(-1), torch.exp(x - lse) - onehot.to(x.dtype), 0.0)",
           "grad = torch.exp(x - lse) - onehot.to(x.dtype)", "the fused loss's logit gradient not zeroed where the label is ignored"),
    Mutant("fused-loss-gradient-not-scaled", FUSED_LOSS, "grad_h = dh * grad_total if dh is not None else None",
           "grad_h = dh", "the fused loss's backward ignores the incoming gradient (1/n, the MTP weight)"),
    Mutant("fused-loss-mean-over-all-positions", FUSED_LOSS, "return total / (y != IGNORE_INDEX).sum().clamp_min(1)",
           "return total / y.numel()", "the fused loss divided by every position, not by the label tokens"),
    # -- the experts' weight gradients, accumulated over a step's micro-batches
    Mutant("expert-grad-added-twice", MOE, "        accumulate_(weight.grad, grad)", "        accumulate_(weight.grad, 2 * grad)",
           "each micro-batch after the first adds its experts' weight gradient twice"),
    Mutant("expert-grad-overwritten", MOE, "    if weight.grad is None:\n        weight.grad = grad.to(",
           "    if True:\n        weight.grad = grad.to(",
           "each micro-batch's experts' weight gradient replaces the sum so far"),
    Mutant("stacked-expert-grads-swapped", MOE,
           "        for weight, part in zip(ctx.weights, (grad[:, :hidden], grad[:, hidden:])):",
           "        for weight, part in zip(ctx.weights, (grad[:, hidden:], grad[:, :hidden])):",
           "the stacked gate/input copy's gradient halves go to the other weight"),
    Mutant("accumulate-kernel-overwrites", ACCUMULATE_KERNEL, "tl.store(d, tl.load(d, mask=mask, other=0.0) + s, mask=mask)",
           "tl.store(d, s, mask=mask)", "the accumulation kernel replaces the gradient sum with the new gradient"),
    # -- q, k, v written by the stacked short convolution as three tensors
    Mutant("conv-pieces-gradient-stride", CONV_KERNEL, "g = tl.load(dout + rows * YS + c[None, :]",
           "g = tl.load(dout + rows * XS + c[None, :]", "each piece's output gradient read with the stacked row stride"),
    # -- gate and input projections stacked into one GEMM, read in place by the activation
    Mutant("stacked-glu-halves-swapped", SITU, "    a, c = y.chunk(2, dim=-1)", "    c, a = y.chunk(2, dim=-1)",
           "the stacked GEMM's halves taken as (input, gate)"),
    Mutant("stacked-situ-row-stride", SITU_KERNEL, "return (offs // hidden) * row_stride + offs % hidden",
           "return (offs // hidden) * hidden + offs % hidden",
           "the fused SiTU reads each stacked row as if it were hidden wide"),
    # -- initialisation
    Mutant("init-output-std-sqrt-l", INIT, "out_std = std / math.sqrt(2 * cfg.num_layers)", "out_std = std / math.sqrt(cfg.num_layers)",
           "output projections at 0.02/sqrt(L) instead of 0.02/sqrt(2L)"),
    Mutant("init-expert-output-std", INIT, "nn.init.normal_(module.w_out, 0.0, out_std)", "nn.init.normal_(module.w_out, 0.0, std)",
           "routed experts' output projections not scaled down"),
    Mutant("init-std-default-changed", CONFIG, "init_std: float = 0.02", "init_std: float = 0.01", "init std 0.01"),
    # -- which implementation runs
    Mutant("projections-auto-always-torch", KDA_PROJ, "impl = next(fn for fn, supports in _BACKENDS.values() if supports(q))",
           "impl = _torch", "auto never picks a kernel"),
    Mutant("triton-fallback-skips-fla", KDA_PROJ, "fallback = _fla if _fla_available(q) and lower_bound is not None else _torch",
           "fallback = _torch", "inputs the Triton kernels cannot take never go to fla"),
    Mutant("kda-auto-order-reversed", KDA_OP, '_AUTO_ORDER = ("triton", "fla", "torch")', '_AUTO_ORDER = ("torch", "fla", "triton")',
           "auto takes the reference before any kernel"),
    # -- attention over padded documents
    Mutant("attention-padding-before-the-document", ATTENTION,
           "q, k, v = (F.pad(x, (0, 0, 0, 0, 0, length - n)) for x in (q, k, v))",
           "q, k, v = (F.pad(x, (0, 0, 0, 0, length - n, 0)) for x in (q, k, v))",
           "the zero rows go before the document, where causality lets every real query see them"),
    Mutant("attention-padded-length-rounds-down", ATTENTION, "return -(-n // step) * step", "return n // step * step or step",
           "documents cut to a multiple of the step instead of padded up to one"),
    # -- FLOP accounting
    Mutant("flops-count-elementwise-params", ACCOUNTING, "3.0 * (2.0 * matmul_parameters(cfg) +",
           "3.0 * (2.0 * (count_parameters(cfg).active - count_parameters(cfg).active_by_component"
           "[\"norms_and_attn_res\"]) +", "norm weights, conv taps and biases counted as matmul FLOPs"),
    Mutant("flops-attention-context-off-by-one", ACCOUNTING, "avg_keys = (seq_len + 1) / 2", "avg_keys = seq_len / 2",
           "causal attention over T/2 keys on average instead of (T+1)/2"),
    Mutant("flops-attention-not-causal", ACCOUNTING, "avg_keys = (seq_len + 1) / 2", "avg_keys = seq_len",
           "attention FLOPs of a non-causal mask"),
    Mutant("flops-kda-grows-with-context", ACCOUNTING, "c = min(KDA_CHUNK, seq_len)", "c = seq_len",
           "KDA's intra-chunk work grows with the context"),
    Mutant("flops-grouped-without-top-k", ACCOUNTING, "else cfg.moe.top_k * _moe_params(cfg)[1]",
           "else _moe_params(cfg)[1]", "the grouped GEMMs priced for one routed expert a token, not k"),
)
