"""What the forward keeps for backward, in bytes per token, from the model config and the checkpointing policy.

An analytic count of the tensors each decoder layer leaves in memory after its forward, component
by component, for the three policies of `moe_lc.parallel.activation_checkpointing`:

- none: every tensor an op saves for its backward (and the residual-stream tensors);
- selective: the outputs of the matmuls and of attention, what the KDA recurrence saves, and the
  layer's output stream tensor (everything else is recomputed);
- full: the layer's output stream tensors only.

The count follows the code tensor by tensor (which op saves which of its inputs or outputs, in
which dtype). Two execution paths differ in what their ops save: the CPU reference ops (the torch
KDA, short convolution and attention) and the GPU's fused kernels under bf16 autocast (Triton
KDA and convolution, CUDA attention). The reference path is checked against the measured count
of `moe_lc.metrics.saved_activations` (tests/test_activation_memory.py); the fused path's
kernel-specific terms are the named constants below, to be calibrated with
`benchmarks/bench_memory.py` on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from moe_lc.config import ModelConfig
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.compile import CompileTarget, RegionalCompile
from moe_lc.parallel.layout import ParallelLayout

FP32 = 4
INDEX = 8  # int64 routing indices
KDA_CHUNK = 64

# The torch reference KDA op (moe_lc.ops._kda_chunk via chunk_kda_from_projections) keeps, per head
# and token, a*K + b*V + c*K*V + e fp32 values besides its output (fitted exactly to its measured
# saved storages: chunk matrices, decays, the triangular solve, the gate).
REFERENCE_KDA_FLOATS = (26.203125, 3.0, 1.0 / 64, 200.5)

# The fused Triton KDA (moe_lc_kernels.kda, save_prep="inverse") keeps per head and token, besides its
# inputs: Aqk (CHUNK values in the activation dtype), the UT inverse X (CHUNK fp32) and the two row
# norms (fp32). Segment start states and transitions (< 10 MB a layer) are not per token.
FUSED_KDA_EXTRA_FP32_PER_HEAD = KDA_CHUNK + 2
FUSED_KDA_EXTRA_ACT_PER_HEAD = KDA_CHUNK

# Attention on CUDA (SDPA, memory-efficient / cuDNN kernels) keeps q, k, v, the output and the
# log-sum-exp (fp32 per head and token).
ATTENTION_LSE_FP32_PER_HEAD = 1

# Working memory of the backward on top of what is stored: per token, the fp32 gradients of a few
# residual-stream tensors in flight, what the fused KDA backward holds while one layer runs
# (per-chunk states and state gradients, bf16 + fp32, T/64 x H x K x V; G and scratch, fp32
# [T, H, K] each), and a share of the heaviest checkpointed layer's recomputed tensors: its
# backward frees them as it goes, so not all are alive at once. The shares are measured
# (benchmarks/bench_memory.py, proxy at 64K on an H200: 5.65 GiB above what is stored under full
# checkpointing, 2.8 GiB under selective; docs/performance.md §12.4).
BACKWARD_STREAM_GRADIENTS = 4
RECOMPUTE_ALIVE_SHARE = {CheckpointMode.none: 0.0, CheckpointMode.selective: 0.25, CheckpointMode.full: 0.45}


def fused_kda_kept_states_bytes_per_head(key_dim: int, value_dim: int) -> float:
    """What ``activation_checkpointing.kda_states`` adds per head and token: every chunk's start
    state (K x V per CHUNK tokens) and Delta (V), both bf16."""
    return 2 * (key_dim * value_dim / KDA_CHUNK + value_dim)


def fused_kda_kept_prep_bytes_per_head(key_dim: int, value_dim: int) -> float:
    """What ``activation_checkpointing.kda_prep`` adds per head and token: the prep's W, Gamma Q and
    Gamma_C K (K each) and U (V) in bf16, G (K) in fp32 and G's per-chunk total (K fp32 per CHUNK tokens)."""
    return 2 * (3 * key_dim + value_dim) + FP32 * key_dim * (1 + 1 / KDA_CHUNK)


def fused_kda_backward_bytes_per_head(key_dim: int, value_dim: int) -> float:
    return key_dim * value_dim * (2 + FP32) / KDA_CHUNK + 2 * FP32 * key_dim


@dataclass(frozen=True)
class ExecutionPath:
    """Which kernels compute the layers and in which dtypes."""

    act: int  # bytes of a matmul output (2 under bf16 autocast or bf16 weights, 4 in fp32)
    stream: int  # bytes of the embedding and the AttnRes mixtures (the weights' dtype)
    casts: bool  # bf16 autocast over fp32 tensors: every linear keeps its own bf16 copy of its input
    fused: bool  # Triton KDA and short convolution, CUDA attention (else the torch reference ops)
    compiled_moe: bool = False  # the MoE glue under regional compile (``compile.targets``' "moe")
    tensor_parallel: bool = False  # DTensor weights: the pre-norms stay out of the mixtures' kernels
    compiled_norms: bool = False  # the RMSNorms under regional compile (``compile.targets``' "norms")


REFERENCE_FP32 = ExecutionPath(act=4, stream=4, casts=False, fused=False)  # CPU, fp32
GPU_AUTOCAST = ExecutionPath(act=2, stream=4, casts=True, fused=True)  # one GPU or ZeRO-1: fp32 weights, autocast
GPU_BF16_WEIGHTS = ExecutionPath(act=2, stream=2, casts=False, fused=True)  # FSDP computing with bf16 weights


def embedding_bytes(cfg: ModelConfig, path: ExecutionPath) -> int:
    """Bytes per value of the stream's first source, the embedding: autocast's dtype under autocast
    (``MoELCModel.start_stream``), the weights' dtype under ``fp32_embedding`` or without autocast."""
    return path.act if path.casts and not cfg.fp32_embedding else path.stream


def gpu_execution_path(layout: ParallelLayout, compile: Optional[RegionalCompile] = None) -> ExecutionPath:
    """How the layers run on GPUs under ``layout`` (resolved): FSDP with bf16 compute weights, else fp32
    weights under bf16 autocast (one process, ZeRO-1, or FSDP with param_dtype float32); with the MoE
    glue compiled where ``compile`` (the run's policy, ``auto`` decided for the layout) compiles it."""
    bf16_weights = layout.wraps_with_fsdp and layout.param_dtype in ("auto", "bfloat16")
    path = GPU_BF16_WEIGHTS if bf16_weights else GPU_AUTOCAST
    path = replace(path, tensor_parallel=layout.tp > 1)
    if compile is not None:
        resolved = compile.resolve("cuda", layout.world_size, layout.tp)
        compiled = resolved.enabled is True
        path = replace(path, compiled_moe=compiled and CompileTarget.moe in resolved.targets,
                       compiled_norms=compiled and CompileTarget.norms in resolved.targets)
    return path


@dataclass
class _Tally:
    """Bytes per token one layer keeps: without checkpointing (none) and under the selective policy."""

    none: float = 0.0
    selective: float = 0.0

    def saved(self, nbytes: float) -> None:
        """A tensor some op saves, recomputed under the selective policy."""
        self.none += nbytes

    def matmul(self, nbytes: float, saved: bool) -> None:
        """A matmul or attention output: kept by the selective policy; saved by a consumer or not."""
        self.selective += nbytes
        if saved:
            self.none += nbytes

    def kept(self, nbytes: float) -> None:
        """Kept under both (what the KDA recurrence saves)."""
        self.none += nbytes
        self.selective += nbytes


def _norm(t: _Tally, width: int, x_bytes: int, path: ExecutionPath, readers: int = 1, rows: int = 1) -> bool:
    """RMSNorm over ``rows`` groups of a ``width``-wide input of ``x_bytes`` per value, whose output
    ``readers`` linears read (0: no op saves it).

    Keeps the normalised fp32 values and the inverse rms; an fp32 copy of a narrower input; its
    output, or under autocast each reader's bf16 copy of an fp32 output. Returns whether the input
    itself stays saved (only an fp32 input is used in place)."""
    t.saved(FP32 * width + FP32 * rows)
    if x_bytes < FP32:
        t.saved(FP32 * width)
    _norm_output(t, width, x_bytes, path, readers)
    return x_bytes == FP32


def _norm_output(t: _Tally, width: int, x_bytes: int, path: ExecutionPath, readers: int) -> None:
    """A norm's output as its readers keep it: under autocast each reader's bf16 copy of a wider output,
    else the output itself (0 readers: no op saves it)."""
    if path.casts and x_bytes > path.act:
        t.saved(readers * path.act * width)
    elif readers:
        t.saved(x_bytes * width)


def fuses_pre_norms(cfg: ModelConfig, path: ExecutionPath) -> bool:
    """Whether the mixtures' kernels apply the sublayers' pre-norms (``attn_res.fused_norm``): on the GPU
    path, with the Triton mixtures, and not under tensor parallelism (``DepthMixer.fuses_norm``)."""
    return cfg.attn_res.fused_norm and path.fused and cfg.attn_res.backend != "torch" and not path.tensor_parallel


def _glu(t: _Tally, rows: float, hidden: int, activation: str, path: ExecutionPath) -> None:
    """W_out act(W_gate x, W_in x) on ``rows`` per token (its input is counted by the caller).

    SwiGLU keeps a and c; SiTU in PyTorch keeps its tanh terms instead, the fused SiTU kernel (GPU
    path) a and c; and W_out keeps the activation's output."""
    keeps_ac = activation == "swiglu" or path.fused
    t.matmul(2 * rows * path.act * hidden, saved=keeps_ac)
    t.saved((0 if keeps_ac else 5) * rows * path.act * hidden)  # PyTorch SiTU's saved terms
    t.saved(rows * path.act * hidden)  # the activation's output


def _kda(t: _Tally, cfg: ModelConfig, path: ExecutionPath) -> None:
    k, d, A = cfg.kda, cfg.d_model, path.act
    H, K = k.num_heads, k.head_dim
    inner, rank = H * K, k.decay_rank or K
    t.matmul(3 * A * inner, saved=True)  # q, k, v projections (the convolutions keep their inputs)
    t.kept((3 if path.fused else 2) * A * inner)  # convolution outputs the recurrence keeps (q, k; v fused)
    if not path.fused:
        t.saved(k.conv_size * 3 * A * inner)  # reference convolution: shifted taps and the SiLU input
    t.matmul(A * rank, saved=True)  # decay_down (kept by decay_up)
    t.matmul(A * inner, saved=path.fused)  # decay logit z
    t.matmul(A * H, saved=path.fused)  # beta logits
    if path.fused:
        t.kept(H * (FP32 * FUSED_KDA_EXTRA_FP32_PER_HEAD + A * FUSED_KDA_EXTRA_ACT_PER_HEAD))
    else:
        a, b, c, e = REFERENCE_KDA_FLOATS
        V = K  # KDA's value head dim is its key head dim
        t.kept(FP32 * H * (a * K + b * V + c * K * V + e))
    if k.output_gate == "low_rank":
        t.matmul(A * (k.output_gate_rank or K), saved=True)
    if path.fused and k.gate_backend != "torch":  # the fused gated norm (moe_lc.ops.output_gate): o, the
        # gate logits and 1 / rms
        t.matmul(A * inner, saved=True)  # the recurrence's output o
        t.matmul(A * inner, saved=True)  # gate logits
        t.saved(FP32 * H)
    else:
        t.selective += A * inner  # the recurrence's output o, kept by the policy ...
        if _norm(t, inner, A, path, rows=H):  # ... and by the per-head output norm when it is fp32
            t.none += A * inner
        t.matmul(A * inner, saved=False)  # gate logits (the sigmoid keeps its output)
        t.saved(A * inner)  # sigmoid(gate)
    t.saved(A * inner)  # the gated output, o_proj's input
    t.matmul(A * d, saved=False)  # o_proj: the sublayer output, counted with the stream


def _kda_readers(cfg: ModelConfig) -> int:
    """Casts of the normed input kept: q, k, v, beta, decay_down and the (first) gate projection each
    cast it under autocast, unless ``fused_projections`` casts it once for all six."""
    return 1 if cfg.kda.fused_projections else 6


def _mla(t: _Tally, cfg: ModelConfig, path: ExecutionPath) -> None:
    m, d, A = cfg.mla, cfg.d_model, path.act
    H, qk = m.num_heads, m.qk_dim
    if m.q_lora_rank:
        t.matmul(A * m.q_lora_rank, saved=A == FP32)  # kept by its norm when fp32
        _norm(t, m.q_lora_rank, A, path)
    t.matmul(A * H * qk, saved=True)  # q (attention keeps it)
    t.matmul(A * m.kv_lora_rank, saved=A == FP32)
    _norm(t, m.kv_lora_rank, A, path)
    padded_v = not path.fused and m.v_dim < qk  # the CPU attention kernel wants v as wide as q
    t.matmul(A * H * (m.qk_nope_dim + m.v_dim), saved=not padded_v or m.qk_rope_dim == 0)  # k_nope, v views
    if m.qk_rope_dim:
        t.matmul(A * m.qk_rope_dim, saved=False)
        t.saved(A * H * qk)  # k = [k_nope, k_shared] (attention keeps it)
    if padded_v:
        t.saved(A * H * qk)  # v padded to q's width
    t.matmul(A * H * (qk if padded_v else m.v_dim) + FP32 * H * ATTENTION_LSE_FP32_PER_HEAD, saved=True)
    hv = H * m.v_dim
    if m.gate:
        t.saved(A * hv)  # o as [B, T, H v] (the gate keeps it)
        if path.fused and m.gate_backend != "torch":  # the fused gate keeps its logits: with stacked
            # projections a column view, which keeps all their columns
            t.matmul(A * hv, saved=True)
            if m.fused_projections:
                t.saved(A * (m.kv_lora_rank + m.qk_rope_dim + (m.q_lora_rank or H * qk)))
        else:
            t.matmul(A * hv, saved=False)
            t.saved(A * hv)  # sigmoid(gate)
    t.saved(A * hv)  # o_proj's input
    t.matmul(A * d, saved=False)


def _mla_readers(cfg: ModelConfig) -> int:
    """Casts of the normed input kept: W_dkv, the shared key, the first q projection and the gate each
    cast it under autocast, unless ``fused_projections`` casts it once for all of them."""
    m = cfg.mla
    return 1 if m.fused_projections else 2 + (m.qk_rope_dim > 0) + bool(m.gate)


def _moe(t: _Tally, cfg: ModelConfig, path: ExecutionPath) -> None:
    e, d, A = cfg.moe, cfg.d_model, path.act
    k, width = e.top_k, e.latent_dim or d
    t.matmul(A * e.num_routed, saved=False)
    t.saved(FP32 * e.num_routed)  # sigmoid scores
    t.saved(INDEX * (3 * k + 1) + FP32 * (2 * k + 1))  # selection, order, rows' tokens, weights
    if e.latent_dim:
        t.matmul(A * width, saved=False)  # z (only gathered)
    t.saved(A * k * width)  # the gathered rows (the experts' input)
    _glu(t, k, e.expert_hidden, e.activation, path)
    # the expert outputs: the combine keeps them for the weights' gradient when fp32, compiled or
    # the Triton kernels' (GPU path, which also keep each slot's row); the eager bf16 reference keeps
    # their fp32 copy instead (upcast, then the weighting; the sum over the slots keeps nothing)
    triton_combine = path.fused and e.dispatch_backend != "torch"
    keeps_rows = A == FP32 or path.compiled_moe or triton_combine
    t.matmul(A * k * width, saved=keeps_rows)
    if not keeps_rows:
        t.saved(FP32 * k * width)
    if triton_combine:
        t.saved(INDEX * k)
    if e.latent_dim:
        if _norm(t, width, A, path):  # the combined u (fp32 when the model is)
            t.saved(A * width)
        t.matmul(A * d, saved=False)
    if e.num_shared:
        _glu(t, 1, e.num_shared * e.expert_hidden, e.activation, path)
        t.matmul(A * d, saved=False)
        if e.fused_projections and path.fused:  # the fused SiTU keeps its input, columns of the stacked
            t.saved(A * (e.num_routed + (e.latent_dim or 0)))  # projection: the router's and z's stay too


def _moe_readers(cfg: ModelConfig) -> int:
    e = cfg.moe
    if e.fused_projections:
        return 1  # one GEMM of x for the router, W_down and the shared experts
    return 1 + bool(e.latent_dim) + bool(e.num_shared)  # the shared experts' two GEMMs are one (GatedFFN)


def _dense_ffn(t: _Tally, cfg: ModelConfig, path: ExecutionPath) -> None:
    _glu(t, 1, cfg.moe.dense_hidden, cfg.moe.activation, path)
    t.matmul(path.act * cfg.d_model, saved=False)


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token one decoder layer keeps for backward under each policy."""

    label: str  # layer<i> or mtp
    none: float
    selective: float
    full: float

    def under(self, mode: CheckpointMode) -> float:
        return {CheckpointMode.none: self.none, CheckpointMode.selective: self.selective,
                CheckpointMode.full: self.full}[CheckpointMode(mode)]


def _sublayer_input(t: _Tally, cfg: ModelConfig, sources: int, stream_bytes: int, readers: int,
                    path: ExecutionPath) -> None:
    """The AttnRes mixture over ``sources`` (when there is more than one) and the norm that reads it
    (in the mixture's kernels where ``fuses_pre_norms``: with the norms compiled, the norm apart less
    the mixture it keeps; with eager norms, everything the norm apart keeps beyond its output)."""
    d = cfg.d_model
    fused = sources > 1 and fuses_pre_norms(cfg, path)
    if fused and not path.compiled_norms:
        t.saved(2 * FP32 * sources + FP32)  # mixture weights and inverse rms per source, the output's inverse rms
        _norm_output(t, d, stream_bytes, path, readers)  # the mixture itself is neither stored nor kept
        return
    _mixture_then_norm(t, d, sources, stream_bytes, readers, path)
    if fused:
        # What the norm apart keeps is counted as an eager norm's (the whole model's plan is calibrated
        # so, docs/performance.md §12.4); compiled, it really keeps the mixture and its inverse rms,
        # which the kernels replace by theirs: one mixture of stream_bytes a value fewer, as measured
        # (§12.16: 1.0 GiB of k3-small's 8-layer step, 16 mixtures of 16K tokens, d 2048, bf16)
        t.saved(-stream_bytes * d)


def _mixture_then_norm(t: _Tally, d: int, sources: int, stream_bytes: int, readers: int, path: ExecutionPath) -> None:
    """The mixture's kernels, then the norm apart (a single source: the norm alone)."""
    if sources > 1:
        t.saved(2 * FP32 * sources)  # mixture weights and inverse rms per source
        if _norm(t, d, stream_bytes, path, readers):
            t.saved(stream_bytes * d)  # the mixture itself, the norm's input
    else:
        _norm(t, d, stream_bytes, path, readers)  # on a stream tensor that is kept anyway


def _layer(cfg: ModelConfig, label: str, kind: str, dense: bool, sources: tuple[int, int], mode: str,
           path: ExecutionPath) -> LayerActivations:
    """One layer whose two sublayers mix ``sources`` = (attention's, FFN's) sources."""
    d, A = cfg.d_model, path.act
    mixed = max(embedding_bytes(cfg, path), A)  # mixtures and the plain residual promote to the wider of the two
    t = _Tally()
    _sublayer_input(t, cfg, sources[0], mixed, _kda_readers(cfg) if kind == "K" else _mla_readers(cfg), path)
    (_kda if kind == "K" else _mla)(t, cfg, path)
    _sublayer_input(t, cfg, sources[1], mixed, 1 if dense else _moe_readers(cfg), path)
    (_dense_ffn if dense else _moe)(t, cfg, path)
    out_bytes = mixed if mode == "none" else A  # the plain residual keeps the embedding's dtype
    t.none += 2 * out_bytes * d  # the stream after each sublayer
    # Selective keeps the layer's new stream tensor; in full mode the sources are the sublayer outputs,
    # of which only the MoE's (a sum) is not a kept matmul output.
    t.selective += (0 if mode == "full" and dense else 1) * out_bytes * d
    outputs = 2 if mode == "full" else 1  # full mode: two new sources; else the new partial sum
    return LayerActivations(label, t.none, t.selective, outputs * out_bytes * d)


def layer_activations(cfg: ModelConfig, path: ExecutionPath) -> list[LayerActivations]:
    """Every decoder layer of the trunk, then the MTP layer, in bytes per token for each policy."""
    mode, block = cfg.attn_res.mode, cfg.attn_res.block_size
    completed, partial = 1, False  # the embedding is the first source
    layers = []
    for i, kind in enumerate(cfg.pattern):
        if mode == "none":
            sources = (1, 1)
        else:
            attn = completed + partial
            sources = (attn, attn + 1 if mode == "full" else completed + 1)
        layers.append(_layer(cfg, f"layer{i}", kind, cfg.is_dense_layer(i), sources, mode, path))
        if mode == "full":
            completed += 2
        elif mode == "block" and (i + 1) % block == 0:
            completed, partial = completed + 1, False
        else:
            partial = True
    if cfg.mtp:
        layers.append(_layer(cfg, "mtp", "M", cfg.is_dense_layer(cfg.num_layers), (1, 1), "none",
                             _mtp_path(path)))
    return layers


def _mtp_path(path: ExecutionPath) -> ExecutionPath:
    """The MTP layer's residual starts from a projection: its stream has the activation dtype."""
    return replace(path, stream=path.act)


def sources_before_layer(cfg: ModelConfig, layer_idx: int) -> int:
    """Residual-stream tensors alive when decoder layer ``layer_idx`` starts: what a pipeline stage
    boundary before it carries (the embedding, completed blocks or sublayer outputs, the partial sum)."""
    mode, block = cfg.attn_res.mode, cfg.attn_res.block_size
    if mode == "none":
        return 1
    if mode == "full":
        return 1 + 2 * layer_idx
    return 1 + layer_idx // block + (layer_idx % block > 0)


def final_sources(cfg: ModelConfig) -> int:
    """Sources of the output mixture (the embedding, completed blocks or outputs, the partial sum)."""
    return sources_before_layer(cfg, cfg.num_layers)


def outside_layers_bytes(cfg: ModelConfig, tokens: int, path: ExecutionPath, loss_chunk_elements: int = 1 << 28,
                         fused_loss: Optional[bool] = None) -> float:
    """Bytes per token kept outside the decoder layers: the embedding, the output mixture and norm, the
    LM loss and the MTP head.

    The fused loss (``MoELCModel.fuses_head_and_loss``: a plain head, so not under tensor parallelism)
    keeps the gradients it computed in the forward: of its input (the norm's dtype) and of the head's
    weight (fp32, one per loss and micro-batch, spread here over its ``tokens``), for the LM and again
    for the MTP loss; it keeps neither the norm's output nor any logits. Otherwise the LM loss keeps
    its log-probabilities, unless it is computed in recomputed chunks, and the MTP loss (never chunked)
    its log-probabilities. ``fused_loss`` None: ``cfg.fused_loss``."""
    fused_loss = cfg.fused_loss if fused_loss is None else fused_loss
    d, A = cfg.d_model, path.act
    mixed = max(embedding_bytes(cfg, path), A)
    t = _Tally()
    t.saved(embedding_bytes(cfg, path) * d)  # the embedding (the first source)
    head_grad = FP32 * cfg.padded_vocab_size * d / tokens  # the fused loss's weight gradient
    chunked = not fused_loss and tokens > max(1, loss_chunk_elements // cfg.padded_vocab_size)
    # the LM head reads the final norm's output; recomputed loss chunks keep that output itself
    _sublayer_input(t, cfg, final_sources(cfg), mixed, 0 if fused_loss else 1,
                    replace(path, casts=False) if chunked else path)
    if fused_loss:
        t.saved(mixed * d + head_grad)
    elif not chunked:
        t.saved(FP32 * cfg.vocab_size)  # log-probabilities
    if cfg.mtp:
        t.saved(path.stream * d)  # the next token's embedding
        _norm(t, d, mixed, path, readers=0)
        _norm(t, d, path.stream, path, readers=0)
        t.saved(2 * A * d)  # the projection's input
        t.saved(A * d)  # its output: the MTP layer's residual
        _norm(t, d, A, path, readers=0 if fused_loss else 1)
        t.saved(A * d + head_grad if fused_loss else FP32 * cfg.vocab_size)
    return t.none


@dataclass
class ActivationEstimate:
    """Bytes per token a micro-batch keeps for backward under one policy, by layer, and the peak extra."""

    policy: ActivationCheckpointing
    by_layer: dict[str, float] = field(default_factory=dict)  # layer<i>, mtp, other

    @property
    def per_token(self) -> float:
        return sum(self.by_layer.values())


def estimate_activations(
    cfg: ModelConfig,
    policy: ActivationCheckpointing,
    tokens: int,
    path: ExecutionPath = GPU_AUTOCAST,
    layers: Optional[list[LayerActivations]] = None,
    fused_loss: Optional[bool] = None,
) -> ActivationEstimate:
    """What one micro-batch of ``tokens`` tokens keeps per token under ``policy`` on ``path``
    (``fused_loss``: as ``outside_layers_bytes``; False under tensor parallelism, None: the config's)."""
    layers = layers if layers is not None else layer_activations(cfg, path)
    by_layer = {}
    for i, layer in enumerate(layers):
        checkpointed = policy.checkpoints(i if layer.label != "mtp" else cfg.num_layers)
        mode = policy.mode if checkpointed else CheckpointMode.none
        by_layer[layer.label] = layer.under(mode)
        if path.fused and mode != CheckpointMode.full and layer.label != "mtp" and cfg.pattern[i] == "K":
            dims = (cfg.kda.head_dim, cfg.kda.head_dim)
            if policy.kda_states:
                by_layer[layer.label] += cfg.kda.num_heads * fused_kda_kept_states_bytes_per_head(*dims)
            if policy.kda_prep:
                by_layer[layer.label] += cfg.kda.num_heads * fused_kda_kept_prep_bytes_per_head(*dims)
    by_layer["other"] = outside_layers_bytes(cfg, tokens, path, fused_loss=fused_loss)
    return ActivationEstimate(policy, by_layer)


def backward_working_bytes_per_token(cfg: ModelConfig, policy: ActivationCheckpointing, path: ExecutionPath,
                                     layers: Optional[list[LayerActivations]] = None) -> float:
    """Extra bytes per token while the backward runs: the recompute of the heaviest checkpointed layer,
    gradients of stream tensors, and the fused KDA backward's buffers."""
    layers = layers if layers is not None else layer_activations(cfg, path)
    recompute = 0.0
    for i, layer in enumerate(layers):
        if policy.checkpoints(i if layer.label != "mtp" else cfg.num_layers):
            recompute = max(recompute, layer.none - layer.under(policy.mode))
    if path.fused:
        recompute *= RECOMPUTE_ALIVE_SHARE[policy.mode]
    kda = 0.0
    if path.fused and "K" in cfg.pattern:
        kda = cfg.kda.num_heads * fused_kda_backward_bytes_per_head(cfg.kda.head_dim, cfg.kda.head_dim)
        if policy.kda_states:  # the per-chunk states are the forward's, counted with what is kept
            kda -= cfg.kda.num_heads * 2 * cfg.kda.head_dim ** 2 / KDA_CHUNK
    return recompute + kda + BACKWARD_STREAM_GRADIENTS * FP32 * cfg.d_model
