"""The kda-moe text decoder (the Kimi K3 / Kimi Linear architecture).

Reading order: norms -> gated activations -> rotary -> gated MLA -> caches -> Kimi Delta Attention -> dense MLP ->
router with Quantile Balancing -> fused experts -> LatentMoE -> Block Attention Residuals -> decoder layer ->
`KdaMoePreTrainedModel` -> `KdaMoeTextModel` -> `KdaMoeForCausalLM`.

Every block is switched by the config, so one code path serves Kimi K3 (bounded KDA gate, full-rank output gate,
gated MLA, AttnRes, LatentMoE with SiTU-GLU and Quantile Balancing), Kimi Linear (softplus gate, low-rank output
gate, plain MLA, plain residuals, full-width SwiGLU experts) and small research configs.
"""

import inspect
import json
import math
import os
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from functools import wraps

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer, StaticCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation import CompileConfig, EosTokenCriteria, GenerationMixin, GenerationMode, MaxLengthCriteria
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import batched_mm_experts_forward
from transformers.loss.loss_utils import LOSS_MAPPING
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import CONFIG_NAME, TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.import_utils import is_tracing
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..compat import (
    CACHE_NAME,
    accepts_legacy_cache_name,
    cached_token_count,
    linear_attention_states,
    model_output,
    output_cache,
    slice_logits_to_keep,
    store_linear_attention_states,
)
from ..configuration import KdaMoeTextConfig
from ..distributed.sharded_loading import check_shards_load
from ..distributed.tensor_parallel import check_fsdp_with_tensor_parallel, data_parallel_group_of_mesh
from ..kernels.arrival_counters import reserve_arrival_counters
from ..kernels.attn_res import attn_res_mix
from ..kernels.conv import short_conv, short_conv_step
from ..kernels.backend import resolve_backend
from ..kernels.kda import kda_decode_step, kda_layer_decode_step, kimi_delta_attention
from ..kernels.linear import decode_projections, fits_projection_kernel
from ..kernels.loss import linear_cross_entropy
from ..kernels.mla import MLA_DECODE_MAX_TOKENS, mla_decode_attention, mla_decode_backend
from ..kernels.moe import (MAX_DECODE_TOKENS, Mxfp4Weight, dequantize_mxfp4, expert_loads, fits_decode_kernel,
                           gated_activation, grouped_experts, moe_decode, mxfp4_row_bytes, router_logits, top_k_routing)
from ..kernels.norm import gated_rms_norm
from ..model_cards import write_model_card, write_pushed_model_card
from ..remote_code import write_remote_code
from .conversion import checkpoint_layout, layout_config_dict, layout_conversions
from .graphed_decoding import decode_steps_per_graph, greedy_decoding, uncaptured_compile_call


# ----------------------------------------------------------------------------------------------------------------
# Offloaded weights
# ----------------------------------------------------------------------------------------------------------------


@contextmanager
def onloaded_weights(*modules: nn.Module):
    """Within the block, the weights of `modules` are on their execution device also where accelerate offloads them
    (`from_pretrained(..., device_map=...)` with CPU or disk offload keeps them on the meta device between calls).

    accelerate loads a module's weights only around that module's own forward; a parent that reads a child's weight
    directly (a fused kernel, the absorbed MLA form, the AttnRes pseudo-query) takes it in this block. Tensors taken
    from the weights inside the block stay valid after it.
    """
    hooked = [(module, module._hf_hook) for module in modules if hasattr(module, "_hf_hook")]
    for module, hook in hooked:
        hook.pre_forward(module)
    try:
        yield
    finally:
        for module, hook in hooked:
            hook.post_forward(module, None)


# ----------------------------------------------------------------------------------------------------------------
# Linear projections of one input
# ----------------------------------------------------------------------------------------------------------------


def runs_its_own_forward(module: nn.Module) -> bool:
    """No hooks around the module's call (tensor-parallel plans, accelerate's offloading) and no replaced forward: a
    kernel may read its weights in place of calling it."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def is_plain_linear(module: nn.Module) -> bool:
    """A bias-free `nn.Linear` whose call is its weight's product alone: no adapter around it (PEFT replaces the
    module or parametrizes its weight), and it `runs_its_own_forward`."""
    return (
        type(module) is nn.Linear
        and module.bias is None
        and not parametrize.is_parametrized(module)
        and runs_its_own_forward(module)
    )


def is_plain_norm(module: nn.Module, rows: torch.Tensor) -> bool:
    """A `KdaMoeRMSNorm` whose call on `rows` is its formula alone (no parametrization, it `runs_its_own_forward`)
    and gives the rows' dtype (its weight has it): a kernel may apply it with its weight and epsilon instead."""
    return (
        type(module) is KdaMoeRMSNorm
        and not parametrize.is_parametrized(module)
        and runs_its_own_forward(module)
        and module.weight.dtype == rows.dtype
    )


def kernel_folds_norm(module: nn.Module, rows: torch.Tensor) -> bool:
    """Whether the decoding kernels apply `module` to `rows` [..., d] themselves: a plain norm (`is_plain_norm`) on
    one token. Every kernel program computes the RMS of all the rows it reads, which at more tokens costs more than
    the norm's own kernel (a graphed step at batch 32 on an H100: 1.52 against 1.31 ms); there the norm runs first."""
    return rows.numel() == rows.shape[-1] and is_plain_norm(module, rows)


def norm_unless_folded(
    input_norm: nn.Module | None, rows: torch.Tensor, kernels_run: bool = True
) -> tuple[torch.Tensor, nn.Module | None]:
    """`(rows, input_norm)` for a sublayer's kernels: `input_norm(rows)` and None where no kernel will fold the norm
    (`kernels_run` False, or not `kernel_folds_norm`), else the rows and the norm as given."""
    if input_norm is not None and not (kernels_run and kernel_folds_norm(input_norm, rows)):
        return input_norm(rows), None
    return rows, input_norm


def linear_projections(
    hidden_states: torch.Tensor,
    *linears: nn.Module | tuple[nn.Module, ...],
    backend: str,
    input_norm: nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Each of `linears` applied to `input_norm(hidden_states)` [..., d] (`hidden_states` itself without a norm); a
    tuple of modules gives one output, their products side by side (a KDA layer's q | k | v, the input of its short
    conv); `residual` is added to the one output (a sublayer's last projection adds its result to the residual
    stream). A decoding step's few tokens go through `decode_projections`, one launch for all of them that adds the
    residual as it stores, writes each tuple's products into one tensor and, where it folds the norm
    (`kernel_folds_norm`; else the norm runs first), applies it to the rows it reads, when the backend resolves to
    Triton, every module `is_plain_linear` and the kernel takes the tensors (`fits_projection_kernel`) outside autograd
    and autocast; anything else calls the norm, then the modules one by one, then adds."""
    groups = [item if isinstance(item, tuple) else (item,) for item in linears]
    modules = [linear for group in groups for linear in group]
    hidden_states, input_norm = norm_unless_folded(input_norm, hidden_states)
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])  # [N, d]
    weights = [linear.weight for linear in modules]
    norm_weight = None if input_norm is None else input_norm.weight
    tensors = [hidden_states, *weights, *(t for t in (norm_weight, residual) if t is not None)]
    if (
        not all(map(is_plain_linear, modules))
        or not fits_projection_kernel(rows, weights)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        or torch.is_autocast_enabled(hidden_states.device.type)
        or resolve_backend(backend, *tensors) != "triton"
    ):
        if input_norm is not None:
            hidden_states = input_norm(hidden_states)
        products = [[linear(hidden_states) for linear in group] for group in groups]
        outputs = tuple(group[0] if len(group) == 1 else torch.cat(group, dim=-1) for group in products)
        return outputs if residual is None else (residual + outputs[0],)
    norm = None if input_norm is None else (norm_weight, input_norm.variance_epsilon)
    outputs = decode_projections(
        rows,
        weights,
        backend="triton",
        group_sizes=[len(group) for group in groups],
        input_norm=norm,
        residual=None if residual is None else residual.reshape(rows.shape[0], -1),
    )
    return tuple(output.view(*hidden_states.shape[:-1], -1) for output in outputs)


# ----------------------------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeRMSNorm(nn.Module):
    """`weight * x / rms(x)`, statistics in fp32, weight starting at 1."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class KdaMoeGatedRMSNorm(nn.Module):
    """KDA output norm: per-head RMSNorm times `sigmoid(gate)` (one fused kernel on GPU)."""

    def __init__(self, head_dim: int, eps: float, backend: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon, backend=self.backend)


# ----------------------------------------------------------------------------------------------------------------
# Gated activations: SwiGLU (Kimi Linear) and SiTU-GLU (Kimi K3)
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeGatedActivation(nn.Module):
    """`act(gate) * up`, the GLU inside every MLP and expert.

    - `"silu"`: SwiGLU, `silu(gate) * up`.
    - `"situ"`: SiTU-GLU, `SiTU(gate) * b2 * tanh(up / b2)` with `SiTU(g) = b1 * tanh(g / b1) * sigmoid(g)`; both
      tanh caps bound the product, which keeps expert outputs (and their gradients) from spiking. fp32 inside.
    """

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__()
        self.kind = config.hidden_act
        self.gate_cap = config.activation_situ_beta
        self.up_cap = config.activation_situ_linear_beta

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gated_activation(gate, up, self.kind, self.gate_cap, self.up_cap)

    def kernel_options(self) -> dict:
        """The expert kernels' arguments for this activation (`moe_decode`, `grouped_experts`)."""
        return dict(activation=self.kind, gate_cap=self.gate_cap, up_cap=self.up_cap)

    def extra_repr(self):
        return f"{self.kind}" + (f", b1={self.gate_cap}, b2={self.up_cap}" if self.kind == "situ" else "")


# ----------------------------------------------------------------------------------------------------------------
# Rotary embedding (only for MLA layers with `mla_use_nope=False`; the default is NoPE)
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeRotaryEmbedding(nn.Module):
    """RoPE on the `qk_rope_head_dim` slice of MLA queries and the shared key."""

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: KdaMoeTextConfig, **kwargs) -> tuple[torch.Tensor, float]:
        dim = config.qk_rope_head_dim
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q: [B, H, T, R], k: [B, 1, T, R], cos/sin: [B, T, R]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ----------------------------------------------------------------------------------------------------------------
# Gated Multi-head Latent Attention
# ----------------------------------------------------------------------------------------------------------------


class LowerRightCausalBias(CausalBias):
    """The causal mask of `query_length` new tokens that are the last of `key_length` keys (query t sees the keys up to
    `key_length - query_length + t`), as PyTorch's `causal_lower_right` bias: SDPA takes it without a mask tensor, on
    CUDA as the bottom-right causal mode of its flash or memory-efficient kernel (elsewhere it builds the [T, S] mask
    itself). Made on an empty tensor: `CausalBias`'s own constructor passes its arguments to the legacy
    `torch.Tensor(*sizes)` and allocates an unused [2, T, S] fp32 CPU tensor (32 GiB at T = 4096, S = 1M)."""

    def __new__(cls, query_length: int, key_length: int):
        return torch.Tensor._make_subclass(cls, torch.empty(0))

    def __init__(self, query_length: int, key_length: int):
        super().__init__(CausalVariant.LOWER_RIGHT, query_length, key_length)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
):
    """query [B, H, T, Dk], key [B, H, S, Dk], value [B, H, S, Dv] -> ([B, T, H, Dv], probs [B, H, T, S])."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


# The latent query / key-value norms of MLA keep RMSNorm's 1e-6 in DeepSeek-V3 and Kimi Linear, whatever rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6


def absorbed_attention_max_tokens(config: KdaMoeTextConfig) -> float:
    """Up to how many new tokens over cached keys the absorbed MLA form costs fewer FLOPs than the expanded one.

    Per head, a (query, key) pair costs 2 kv_lora + rope multiply-adds absorbed (scores over the latent and rope key,
    the latent as value) and nope + rope + v expanded, whose keys cost kv_lora (nope + v) each to expand once. So T new
    tokens over S keys favour the absorbed form while T (2 kv_lora - nope - v) < kv_lora (nope + v): 85 tokens at the
    benchmarks' widths (256 / 64 / 64), 171 at DeepSeek-V3's and K3's (512 / 128 / 128); always where the latent is
    no wider than the heads."""
    extra_per_pair = 2 * config.kv_lora_rank - config.qk_nope_head_dim - config.v_head_dim
    if extra_per_pair <= 0:
        return math.inf
    return config.kv_lora_rank * (config.qk_nope_head_dim + config.v_head_dim) / extra_per_pair


class KdaMoeAttention(nn.Module):
    """Gated MLA. The cache holds only the compressed latent (`kv_lora_rank` + `qk_rope_head_dim` per token).

    Prefill expands the latent into per-head keys and values, and so do long prefill chunks that continue a cache.
    Decoding and short chunks (`absorbed_attention_max_tokens`) use the absorbed form: `W_UK` is folded into the
    query and `W_UV` into the output, so attention runs as one-head MQA straight over the latent cache and a step
    never materialises per-head keys. Under SDPA, unpadded chunks of
    several tokens over a dynamic cache get a `LowerRightCausalBias` for a mask, never a [T, S] tensor. On the Triton
    backend a decoding step's attention is one kernel (`mla_decode_attention`) that reads each cache tile once for a
    block of heads.
    With `mla_use_output_gate`, the per-head output is multiplied by `sigmoid(g_proj(x))` before `o_proj`.
    """

    def __init__(self, config: KdaMoeTextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.attention_dropout = config.attention_dropout
        self.num_key_value_groups = 1  # keys/values are handed to the attention function with every head
        self.is_causal = True
        self.scaling = self.qk_head_dim**-0.5
        hidden, heads = config.hidden_size, self.num_heads

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KdaMoeRMSNorm(self.q_lora_rank, eps=MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KdaMoeRMSNorm(self.kv_lora_rank, eps=MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.g_proj = nn.Linear(hidden, heads * self.v_head_dim, bias=False) if config.mla_use_output_gate else None
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=False)
        self.absorbed_max_tokens = absorbed_attention_max_tokens(config)

    def decodes_with_kernel(
        self, seq_len: int, latent: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict
    ) -> bool:
        """Whether the absorbed attention runs as `mla_decode_attention`'s Triton kernel (each latent cache tile read
        once for a block of heads): when the kernel backend resolves to Triton for the cache, for up to
        `MLA_DECODE_MAX_TOKENS` new tokens, without autograd, attention dropout or attention weights to return.
        Several new tokens also need a mask: transformers passes them none only on a static cache's first forward,
        meaning SDPA's causal alignment with the cache's start, whereas the kernel aligns them with the cache's end
        (what a `LowerRightCausalBias` asks for)."""
        if seq_len > MLA_DECODE_MAX_TOKENS or (attention_mask is None and seq_len > 1) or torch.is_grad_enabled():
            return False
        dropout = self.training and self.attention_dropout > 0
        if dropout or kwargs.get("output_attentions", self.config.output_attentions):
            return False
        return mla_decode_backend(self.config.kernel_backend, latent) == "triton"

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        sequence_shard=None,
        input_norm: KdaMoeRMSNorm | None = None,
        residual: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`residual + o_proj(attention(input_norm(hidden_states)))`, attention weights or None); without
        `input_norm` / `residual` the input as it is and the output alone. A decoding step's projections apply the
        norm and add the residual (`linear_projections`)."""
        batch_size, seq_len = hidden_states.shape[:2]

        # the projections of the input (in one launch for a decoding step's few tokens): the query or its low-rank
        # factor, the compressed key-value latent with the rotary key, the output gate
        query_proj = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        gate_proj = [] if self.g_proj is None else [self.g_proj]
        query, compressed, *gate = linear_projections(
            hidden_states, query_proj, self.kv_a_proj_with_mqa, *gate_proj, backend=self.config.kernel_backend,
            input_norm=input_norm,
        )
        if self.q_lora_rank is not None:
            query = self.q_b_proj(self.q_a_layernorm(query))
        heads = query.shape[-1] // self.qk_head_dim  # this rank's heads under tensor parallelism, else all of them
        query = query.view(batch_size, seq_len, heads, self.qk_head_dim).transpose(1, 2)  # [B, H, T, nope + rope]
        q_nope, q_rope = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, k_rope = compressed.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent).view(batch_size, 1, seq_len, self.kv_lora_rank)
        k_rope = k_rope.view(batch_size, 1, seq_len, self.qk_rope_head_dim)
        if position_embeddings is not None:
            q_rope, k_rope = apply_rotary_pos_emb(q_rope, k_rope, *position_embeddings)
        if sequence_shard is not None:  # context parallelism: the latent keys of every token up to this slice's end
            latent, k_rope = sequence_shard.gather_keys(latent, k_rope)

        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx)  # [B, 1, S, kv_lora], [B, 1, S, rope]
        kv_len = latent.shape[2]
        # The absorbed form once the keys reach beyond this forward's tokens, for as many new tokens as it is the
        # cheaper one (`absorbed_attention_max_tokens`: decoding, speculative windows, short chunks; longer prefill
        # chunks expand the cache instead), and always under context parallelism, whose gathered keys span the whole
        # sequence. It reads kv_b_proj's weight directly, so it is used only when that weight is the plain nn.Linear
        # one (an adapter wrapped around kv_b_proj, e.g. LoRA, keeps the expanded form).
        absorbed = (
            kv_len > seq_len
            and (seq_len <= self.absorbed_max_tokens or sequence_shard is not None)
            and type(self.kv_b_proj) is nn.Linear
        )

        if absorbed:
            with onloaded_weights(self.kv_b_proj):
                w_uk, w_uv = self.kv_b_proj.weight.view(heads, -1, self.kv_lora_rank).split(
                    [self.qk_nope_head_dim, self.v_head_dim], dim=1
                )  # [H, nope, kv_lora], [H, v, kv_lora]
            q_nope = torch.matmul(q_nope, w_uk)  # [B, H, T, kv_lora]: the query against the latent

        if absorbed and self.decodes_with_kernel(seq_len, latent, attention_mask, kwargs):
            kernel_mask = None if isinstance(attention_mask, LowerRightCausalBias) else attention_mask
            attn_output = mla_decode_attention(
                q_nope, q_rope, latent, k_rope, kernel_mask, scale=self.scaling, backend="triton"
            )  # [B, T, H, kv_lora]
            attn_weights = None
        else:
            if absorbed:  # one key head, [B, 1, S, kv_lora + rope], and its value, the latent, shared by every head
                key, value = torch.cat([latent, k_rope], dim=-1), latent
            else:
                kv = self.kv_b_proj(latent.squeeze(1)).view(batch_size, kv_len, heads, -1).transpose(1, 2)
                k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # [B, H, S, nope | v]
                key = torch.cat([k_nope, k_rope.expand(batch_size, heads, kv_len, -1)], dim=-1)
            query = torch.cat([q_nope, q_rope], dim=-1)
            dropout = 0.0 if not self.training else self.attention_dropout
            if sequence_shard is not None:  # context parallelism: block by block over the gathered keys, no mask
                attn_output, attn_weights = sequence_shard.attention(query, key, value, self.scaling, dropout), None
            else:
                attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                    self.config._attn_implementation, eager_attention_forward
                )
                attn_output, attn_weights = attention_interface(
                    self,
                    query,
                    key.expand(batch_size, heads, kv_len, -1),
                    value.expand(batch_size, heads, kv_len, -1),
                    attention_mask,
                    dropout=dropout,
                    scaling=self.scaling,
                    **kwargs,
                )  # [B, T, H, v] (absorbed: [B, T, H, kv_lora])
        if absorbed:
            attn_output = torch.matmul(attn_output.transpose(1, 2), w_uv.mT).transpose(1, 2)  # [B, T, H, v]
        if gate:
            attn_output = attn_output * torch.sigmoid(gate[0]).view(batch_size, seq_len, heads, -1)
        (attn_output,) = linear_projections(
            attn_output.reshape(batch_size, seq_len, -1), self.o_proj, backend=self.config.kernel_backend,
            residual=residual,
        )
        return attn_output, attn_weights


# ----------------------------------------------------------------------------------------------------------------
# Caches: MLA latents and KDA states; the dynamic one rolls back (assisted decoding), the static one never moves
# (compiled decoding, CUDA graphs)
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeStateLayer(LinearAttentionLayer):
    """What the KDA layer reads from either of our caches' KDA layers: the states it continues from."""

    def states(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv state, recurrent state) to continue from, or (None, None) before the first forward."""
        if not self.has_previous_state[0]:
            return None, None
        return self.conv_states[0], self.recurrent_states[0]


class KdaMoeLinearAttentionCacheLayer(KdaMoeStateLayer):
    """The cache of one KDA layer: conv state [B, C, W-1] and fp32 recurrent state [B, H, K, V], as the layer's
    kernels write them, and the number of tokens seen.

    Assisted and prompt-lookup decoding verify a window of drafted tokens in one forward, then `crop` the rejected
    ones. A recurrent state cannot be run backwards, so while generate() records the past (`activate_past_recording`)
    the layer also keeps the recurrent state before and after each recent token, and the conv inputs behind them;
    `crop(-n)` then puts back the states of n tokens before the end, without recomputing anything.
    """

    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens_seen = 0
        self.recurrent_states_to_keep: int | None = None
        self.recurrent_history: list[torch.Tensor] = []  # the state before the recorded tokens, then after each
        self.conv_history: torch.Tensor | None = None  # [B, C, W-1 + recorded]: the recorded tokens' conv inputs,
        # after the W-1 before them, so the conv state after any of them is a slice

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs):
        """Start recording. `recurrent_states_to_keep`: the most tokens one `crop` removes (the draft length);
        a later call without it keeps the count."""
        self.record_past = True
        if recurrent_states_to_keep is not None:
            self.recurrent_states_to_keep = recurrent_states_to_keep

    def tokens_to_record(self, new_tokens: int) -> int:
        """How many of a forward's last tokens need their own states kept: none unless recording; all of a window
        that continues a state (a draft or its verification); of a first forward (the prompt, ending with the first
        drafts), the last `recurrent_states_to_keep`."""
        if not self.record_past:
            return 0
        if self.has_previous_state[0] or self.recurrent_states_to_keep is None:
            return new_tokens
        return min(new_tokens, self.recurrent_states_to_keep)

    def update_states(
        self,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        new_tokens: int,
        conv_inputs: torch.Tensor | None = None,
        token_states: list[torch.Tensor] | None = None,
    ) -> None:
        """Take the final states of a forward over `new_tokens` tokens (the kernels' outputs, or the cached tensors
        they updated in place). While recording also `conv_inputs` [B, T, C] (the forward's conv inputs) and
        `token_states` (the recurrent state before the forward's last `tokens_to_record` tokens, then after each)."""
        if token_states is not None:
            self._record(conv_inputs, token_states, conv_state.shape[-1])
        self.conv_states[0], self.recurrent_states[0] = conv_state, recurrent_state
        if not self.has_previous_state[0]:
            self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
            self.has_previous_state[0] = True
            self.device, self.dtype = conv_state.device, conv_state.dtype
        self.tokens_seen += new_tokens

    def _record(self, conv_inputs: torch.Tensor, token_states: list[torch.Tensor], width: int) -> None:
        if self.recurrent_history:  # the new tokens follow the recorded ones
            conv_history = torch.cat([self.conv_history, conv_inputs.mT], dim=-1)
            states = self.recurrent_history + token_states[1:]
        else:
            previous = self.conv_states[0]
            if not self.has_previous_state[0]:
                previous = conv_inputs.new_zeros(conv_inputs.shape[0], conv_inputs.shape[-1], width)
            conv_history = torch.cat([previous, conv_inputs.mT], dim=-1)
            states = list(token_states)
        kept = max(len(token_states) - 1, self.recurrent_states_to_keep or 0)
        self.recurrent_history = states[-(kept + 1) :]
        self.conv_history = conv_history[..., -(kept + width) :].clone()  # not a view that holds the whole prompt

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the last `-tokens_to_remove` tokens (transformers passes a count <= 0) to the states recorded
        before them, and drop the recorded states."""
        if not self.record_past:
            raise RuntimeError(
                "`crop` was called on a KDA cache layer that does not record its past states; call "
                "`activate_past_recording` before the forward that `crop` should undo."
            )
        if tokens_to_remove > 0:
            raise ValueError(f"KDA cache layers crop by a negative count of tokens to remove, got {tokens_to_remove}.")
        removed = -tokens_to_remove
        if removed:
            if removed >= len(self.recurrent_history):
                raise ValueError(
                    f"Cannot roll a KDA cache layer back by {removed} tokens: it recorded the states of its last "
                    f"{max(len(self.recurrent_history) - 1, 0)} tokens. Pass the draft length to generate() "
                    f"(`num_assistant_tokens={removed}` or more) so that enough states are kept."
                )
            width = self.conv_states[0].shape[-1]
            self.recurrent_states[0] = self.recurrent_history[-1 - removed]
            self.conv_states[0] = self.conv_history[..., -removed - width : -removed].contiguous()
            self.tokens_seen -= removed
        self.recurrent_history, self.conv_history = [], None

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def reset(self) -> None:
        super().reset()
        self.tokens_seen = 0
        self.recurrent_history, self.conv_history = [], None


class KdaMoeCache(DynamicCache):
    """The model's cache: a `DynamicLayer` (the compressed latent) per MLA layer, a `KdaMoeLinearAttentionCacheLayer`
    per KDA layer. generate() builds one by default. Every layer counts its tokens, so `get_seq_length` also works on a
    model without MLA layers, and `crop` rolls KDA layers back (assisted and prompt-lookup decoding).

    It is not compileable (`is_compileable` is False, as for transformers' `DynamicCache`): generate() compiles the
    decode step only with `cache_implementation="static"` (a `KdaMoeStaticCache`), whose tensors never move.
    """

    is_compileable = False

    def __init__(self, config: PreTrainedConfig):
        super().__init__(config=config)
        self.layers = [
            KdaMoeLinearAttentionCacheLayer() if isinstance(layer, LinearAttentionLayer) else layer
            for layer in self.layers
        ]

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Start recording the states `crop` rolls back to (see `KdaMoeLinearAttentionCacheLayer`)."""
        for layer in self.layers:
            if isinstance(layer, KdaMoeLinearAttentionCacheLayer):
                layer.activate_past_recording(recurrent_states_to_keep)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0


def mark_static_address(tensor: torch.Tensor) -> None:
    """Tell torch.compile that `tensor` keeps its address for good, so a compiled step that updates it in place is
    replayed as a CUDA graph (dynamo refuses the mark while tracing: a tensor made inside a compiled region is not)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)


class KdaMoeStaticLinearAttentionCacheLayer(KdaMoeStateLayer):
    """The cache of one KDA layer in a `KdaMoeStaticCache`: conv state [B, C, W-1], fp32 recurrent state [B, H, K, V]
    and the token count, in tensors allocated once (with the cache, or at the first forward) and from then on updated
    in place. Their addresses never change, so a compiled decode step updates them as static inputs and a CUDA graph
    replays it. It keeps no past states, so it cannot be cropped (assisted decoding needs a `KdaMoeCache`).

    Every KDA layer of a cache sees the same tokens: the first (`counting_layer`) counts them and the others share its
    count, one in-place add a forward instead of one a layer.
    """

    is_croppable = False

    def __init__(self, counting_layer: "KdaMoeStaticLinearAttentionCacheLayer | None" = None, **kwargs):
        super().__init__(**kwargs)
        self.counting_layer = counting_layer or self
        self.tokens_seen = torch.zeros((), dtype=torch.long)  # a tensor: a compiled step counts without recompiling

    def allocate(self, conv_shape: tuple[int, ...], recurrent_shape: tuple[int, ...], dtype, device) -> None:
        """Allocate the zeroed state tensors: conv state in `dtype`, recurrent state in fp32."""
        self.conv_states[0] = torch.zeros(conv_shape, dtype=dtype, device=device)
        self.recurrent_states[0] = torch.zeros(recurrent_shape, dtype=torch.float32, device=device)
        reserve_arrival_counters(device, recurrent_shape[0] * recurrent_shape[1])  # before any step is captured
        # the counting layer allocates first (the cache's and a forward's layer order)
        self.tokens_seen = self.tokens_seen.to(device) if self.counts_tokens else self.counting_layer.tokens_seen
        for tensor in (self.conv_states[0], self.recurrent_states[0], self.tokens_seen):
            mark_static_address(tensor)
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.device, self.dtype = device, dtype

    def tokens_to_record(self, new_tokens: int) -> int:
        return 0

    def update_states(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, new_tokens: int, **kwargs) -> None:
        """Copy the final states of a forward over `new_tokens` tokens into the fixed tensors; a state the kernels
        updated in place (the cached tensor itself, as in a decoding step) is left as it is."""
        if not self.is_conv_states_initialized[0]:
            self.allocate(conv_state.shape, recurrent_state.shape, conv_state.dtype, conv_state.device)
        if conv_state is not self.conv_states[0]:
            self.conv_states[0].copy_(conv_state)
        if recurrent_state is not self.recurrent_states[0]:
            self.recurrent_states[0].copy_(recurrent_state)
        if not self.has_previous_state[0]:
            self.has_previous_state[0] = True
        if self.counts_tokens:
            self.tokens_seen.add_(new_tokens)

    @property
    def counts_tokens(self) -> bool:
        return self.counting_layer is self

    def get_seq_length(self) -> torch.Tensor | int:
        return self.tokens_seen if self.is_conv_states_initialized[0] else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows of the chosen beams, in place."""
        if self.is_conv_states_initialized[0]:
            for states in (self.conv_states, self.recurrent_states):
                states[0].copy_(states[0].index_select(0, beam_idx.to(states[0].device)))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "A KdaMoeStaticCache cannot be cropped: its KDA layers keep only their current states. Assisted and "
            "prompt-lookup decoding roll KDA states back with the default cache, a KdaMoeCache (leave "
            "`cache_implementation` unset)."
        )

    def reset(self) -> None:
        super().reset()
        if self.counts_tokens:
            self.tokens_seen.zero_()


class KdaMoeStaticCache(StaticCache):
    """The cache of `generate(..., cache_implementation="static")`: every tensor is allocated once, for `batch_size`
    sequences of up to `max_cache_len` tokens, and updated in place. MLA layers keep their latents (`kv_lora_rank` +
    `qk_rope_head_dim` per token) in transformers' `StaticLayer`, KDA layers their states in a
    `KdaMoeStaticLinearAttentionCacheLayer`, and the token counts are tensors, so generate() compiles the decode step
    (`generation_config.compile_config`) with `fullgraph=True`, without recompiling from one step to the next, and on
    CUDA replays it as a CUDA graph.

    With `batch_size`, `dtype` and `device` the tensors are allocated here (generate() passes them); without, at the
    first forward.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        max_cache_len: int,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs,
    ):
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        layers, counting_layer = [], None
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):
                layer = KdaMoeStaticLinearAttentionCacheLayer(counting_layer=counting_layer)
                counting_layer = counting_layer or layer
            layers.append(layer)
        self.layers = layers
        if batch_size is not None:
            self.allocate(config.get_text_config(decoder=True), batch_size, dtype, device)

    def allocate(self, config: KdaMoeTextConfig, batch_size: int, dtype: torch.dtype, device) -> None:
        """Allocate every layer's tensors for `batch_size` sequences (activations in `dtype`)."""
        heads, head_dim = config.linear_num_heads, config.linear_head_dim
        conv_shape = (batch_size, 3 * heads * head_dim, config.linear_conv_kernel_dim - 1)  # q | k | v channels
        for layer in self.layers:
            if isinstance(layer, KdaMoeStaticLinearAttentionCacheLayer):
                layer.allocate(conv_shape, (batch_size, heads, head_dim, head_dim), dtype, device)
            else:  # the latent [B, 1, S, kv_lora_rank] as keys, the rotary key [B, 1, S, qk_rope_head_dim] as values
                latent = torch.empty(batch_size, 1, 0, config.kv_lora_rank, dtype=dtype, device=device)
                layer.lazy_initialization(latent, latent.new_empty(batch_size, 1, 0, config.qk_rope_head_dim))

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor | int:
        """Tokens held by a layer: a tensor once the layer holds any (read on the host only outside compiled code)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0


# ----------------------------------------------------------------------------------------------------------------
# Kimi Delta Attention
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeDeltaAttention(nn.Module):
    """Kimi Delta Attention: a gated delta rule with channel-wise decay, per head state S [K, V] in fp32.

    q, k, v = SiLU(short causal conv(W x)); the decay `g` comes from a rank-K projection plus `dt_bias`, through
    either the bounded `gate_lower_bound * sigmoid(exp(A_log) * z)` (K3) or `-exp(A_log) * softplus(z)` (Kimi
    Linear); `beta = sigmoid(b_proj(x))`. The L2 norm of q/k, the gate activation and the beta sigmoid happen inside
    `kimi_delta_attention`, so the Triton backend fuses them. Output: `o_proj(RMSNorm(o) * sigmoid(gate))`. A decoding
    step (one token, no autograd) runs everything between the projections and `o_proj` as one `kda_layer_decode_step`
    (one kernel on Triton).

    Cache per layer: the conv state (last `kernel - 1` inputs of q, k, v) and the recurrent state S.
    """

    def __init__(self, config: KdaMoeTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.gate_lower_bound = config.gate_lower_bound
        self.backend = config.kernel_backend
        hidden, width = config.hidden_size, self.num_heads * self.head_dim

        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        # One depthwise conv over the concatenated q | k | v channels: weight [3 * H * K, 1, kernel].
        self.conv1d = nn.Conv1d(3 * width, 3 * width, config.linear_conv_kernel_dim, groups=3 * width, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, width, bias=False)
            self.g_a_proj = self.g_b_proj = None
        else:
            self.g_proj = None
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = KdaMoeGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps, backend=config.kernel_backend)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    @staticmethod
    def up_projection(
        low_rank: torch.Tensor, up_proj: nn.Linear | None, defer: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`up_proj(low_rank)`, None), or with `defer` and a plain linear `up_proj` (`is_plain_linear`)
        (`low_rank`, its weight) for the decode step to multiply; `up_proj` None: (`low_rank`, None) (a full-rank
        gate's logits)."""
        if up_proj is None:
            return low_rank, None
        if defer and is_plain_linear(up_proj):
            return low_rank, up_proj.weight
        return up_proj(low_rank), None

    def delta_rule_with_token_states(
        self, kda_inputs: tuple[torch.Tensor, ...], initial_state: torch.Tensor | None, recorded: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """KDA over a forward whose last `recorded` tokens keep their own states (assisted decoding's rollback).

        The tokens before them run in the chunked form, then one decoding step per token on a copy of the state.
        Returns (output [B, T, H, V], the recurrent state before the recorded tokens and after each of them).
        """
        per_token, parameters = kda_inputs[:5], kda_inputs[5:]  # (q, k, v, g, beta) [B, T, ...], (A_log, dt_bias)
        options = dict(gate_lower_bound=self.gate_lower_bound, backend=self.backend)
        batch_size, seq_len = per_token[0].shape[:2]
        first = seq_len - recorded
        outputs, state = [], initial_state
        if first:
            output, state = kimi_delta_attention(
                *(x[:, :first] for x in per_token), *parameters, initial_state=state, output_final_state=True, **options
            )
            outputs.append(output)
        if state is None:
            heads = per_token[0].shape[2]
            state = per_token[0].new_zeros(batch_size, heads, self.head_dim, self.head_dim, dtype=torch.float)
        states = [state]
        for t in range(first, seq_len):
            state = state.clone(memory_format=torch.contiguous_format)  # the decode kernels update it in place
            outputs.append(kda_decode_step(*(x[:, t : t + 1] for x in per_token), *parameters, state, **options))
            states.append(state)
        return torch.cat(outputs, dim=1), states

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        sequence_shard=None,
        input_norm: KdaMoeRMSNorm | None = None,
        residual: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`residual + o_proj(KDA(input_norm(hidden_states)))` (without `input_norm` / `residual`: the input as it is,
        the output alone); a decoding step's projections apply the norm and add the residual (`linear_projections`).
        `sequence_shard` (context parallelism, `kda_moe.distributed`): this forward holds one slice of a sequence
        split across ranks; the conv reads the previous slice's last inputs and the delta rule continues the state of
        every earlier slice."""
        batch_size, seq_len = hidden_states.shape[:2]

        if attention_mask is not None:
            # Padding must leave the state as if the pad tokens were absent: they enter the conv as zeros, and their
            # decay and write strength become exactly 0 (the most negative logit saturates both gates to 0).
            pad = ~attention_mask.bool()[..., None]
            hidden_states = hidden_states.masked_fill(pad, 0.0)
        # the six projections of the input, in one launch for a decoding step's few tokens: q | k | v side by side
        # (the conv's input), the decay gate's low-rank factor, beta, and the output gate (or its low-rank factor)
        output_gate_proj = self.g_proj if self.g_proj is not None else self.g_a_proj
        conv_inputs, gate_low_rank, beta_logits, output_gate = linear_projections(
            hidden_states, (self.q_proj, self.k_proj, self.v_proj), self.f_a_proj, self.b_proj, output_gate_proj,
            backend=self.backend, input_norm=input_norm,
        )
        if attention_mask is not None:
            beta_logits = beta_logits.masked_fill(pad, torch.finfo(beta_logits.dtype).min)

        # Under tensor parallelism every per-head tensor holds this rank's heads only: widths come from the tensors.
        width = conv_inputs.shape[-1] // 3
        head_shape = (batch_size, seq_len, width // self.head_dim, self.head_dim)
        # our caches' layers hand out and take the states directly; a transformers cache goes through its API
        layer_cache = cache.layers[self.layer_idx] if isinstance(cache, (KdaMoeCache, KdaMoeStaticCache)) else None
        if layer_cache is not None:
            conv_state, recurrent_state = layer_cache.states()
            # assisted decoding: how many of this forward's last tokens keep their own states, for `cache.crop`
            recorded = layer_cache.tokens_to_record(seq_len)
        else:
            conv_state, recurrent_state = linear_attention_states(cache, self.layer_idx)
            recorded = 0
        with onloaded_weights(self.conv1d, self.o_norm):
            conv_weight, o_norm_weight = self.conv1d.weight.squeeze(1), self.o_norm.weight  # [3 * H * K, kernel], [K]
        if sequence_shard is not None:
            conv_state = sequence_shard.conv_history(conv_inputs, conv_weight.shape[1])
        token_states = None
        decoding = conv_state is not None and seq_len == 1 and not recorded and not torch.is_grad_enabled()
        # a decoding step hands the gates' low-rank inputs with the plain up-projections' weights to its kernel, which
        # multiplies them per head; the decay gate's only without a mask (whose padding fills its logits first)
        gate_logits, gate_weight = self.up_projection(gate_low_rank, self.f_b_proj, decoding and attention_mask is None)
        output_gate, output_gate_weight = self.up_projection(output_gate, self.g_b_proj, decoding)
        if attention_mask is not None:
            gate_logits = gate_logits.masked_fill(pad, torch.finfo(gate_logits.dtype).min)
        if decoding:
            # generate() runs without autograd: one token per sequence; the conv, the KDA step and the gated norm in
            # one call (one kernel on Triton), both cached states updated in place
            output = kda_layer_decode_step(
                conv_inputs[:, 0],
                conv_weight,
                conv_state,
                gate_logits[:, 0],
                beta_logits[:, 0],
                self.A_log,
                self.dt_bias,
                recurrent_state,
                output_gate[:, 0],
                o_norm_weight,
                self.o_norm.variance_epsilon,
                g_weight=gate_weight,
                gate_weight=output_gate_weight,
                gate_lower_bound=self.gate_lower_bound,
                backend=self.backend,
            )  # [B, H * V]
        else:
            if conv_state is not None and seq_len == 1 and not recorded:  # one token under autograd
                qkv = short_conv_step(conv_inputs[:, 0], conv_weight, conv_state, backend=self.backend)[:, None]
            else:
                qkv, conv_state = short_conv(
                    conv_inputs,
                    conv_weight,
                    initial_state=conv_state,
                    output_final_state=cache is not None,
                    cu_seqlens=cu_seqlens,
                    backend=self.backend,
                )
            query, key, value = (x.reshape(head_shape) for x in qkv.split(width, dim=-1))

            kda_inputs = (query, key, value, gate_logits.view(head_shape), beta_logits, self.A_log, self.dt_bias)
            if recorded:
                core_attn_out, token_states = self.delta_rule_with_token_states(kda_inputs, recurrent_state, recorded)
                recurrent_state = token_states[-1]
            elif sequence_shard is not None:
                core_attn_out = sequence_shard.delta_rule(
                    *kda_inputs, gate_lower_bound=self.gate_lower_bound, backend=self.backend
                )
            else:
                core_attn_out, recurrent_state = kimi_delta_attention(
                    *kda_inputs,
                    gate_lower_bound=self.gate_lower_bound,
                    initial_state=recurrent_state,
                    output_final_state=cache is not None,
                    cu_seqlens=cu_seqlens,
                    backend=self.backend,
                )  # [B, T, H, V], [B, H, K, V] fp32
            output = self.o_norm(core_attn_out, output_gate.view(head_shape))
        if layer_cache is not None:
            layer_cache.update_states(
                conv_state, recurrent_state, seq_len, conv_inputs=conv_inputs, token_states=token_states
            )
        elif cache is not None:  # a transformers cache built by the caller
            store_linear_attention_states(cache, self.layer_idx, conv_state, recurrent_state, seq_len)

        (output,) = linear_projections(
            output.reshape(batch_size, seq_len, width), self.o_proj, backend=self.backend, residual=residual
        )
        return output


# ----------------------------------------------------------------------------------------------------------------
# Dense MLP (dense layers and shared experts)
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeMLP(nn.Module):
    def __init__(self, config: KdaMoeTextConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = KdaMoeGatedActivation(config)
        self.backend = config.kernel_backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_norm: KdaMoeRMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + down(act(gate(x), up(x)))` with `x = input_norm(hidden_states)`, as the attention modules."""
        gate, up = linear_projections(
            hidden_states, self.gate_proj, self.up_proj, backend=self.backend, input_norm=input_norm
        )
        (output,) = linear_projections(self.act_fn(gate, up), self.down_proj, backend=self.backend, residual=residual)
        return output


# ----------------------------------------------------------------------------------------------------------------
# Router and auxiliary-loss-free balancing
# ----------------------------------------------------------------------------------------------------------------


QUANTILE_STEP = 0.7


# `KdaMoeRouter.balancing_group` until `set_balancing_group` names one: every rank holds its own batch (DDP, FSDP)
DEFAULT_GROUP = "default"


def data_parallel_group(group=DEFAULT_GROUP) -> "torch.distributed.ProcessGroup | None":
    """The process group whose ranks hold different tokens and must agree on the expert biases, or None where there is
    nothing to pool (one process, or `group` is None or has one rank). `DEFAULT_GROUP`: the default group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or group is None:
        return None
    group = torch.distributed.group.WORLD if isinstance(group, str) else group
    return group if torch.distributed.get_world_size(group) > 1 else None


def pooled_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        torch.distributed.all_reduce(tensor, group=group)
    return tensor


def column_quantile(values: torch.Tensor, rank: int, bins: int | None, group) -> torch.Tensor:
    """The `rank`-th largest entry of every column of values [m, E] (1-based), over the tokens of every rank.

    On one process (`bins=None`) the exact order statistic. Under data parallelism each rank bins its values on a
    shared range, the per-expert histograms [E, bins] are summed across ranks, and the quantile is read from the
    pooled histogram with linear interpolation inside its bin: every rank gets the same answer, within one bin width.
    """
    if bins is None:
        return values.topk(rank, dim=0).values[-1]
    low, high = values.min(0).values.clone(), values.max(0).values.clone()
    if group is not None:
        torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
        torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    width = (high - low).clamp_min(1e-12) / bins  # [E]
    index = ((values - low) / width).floor().clamp(0, bins - 1).long()  # [m, E]
    counts = torch.zeros(values.shape[1], bins, dtype=torch.float64, device=values.device)
    counts.scatter_add_(1, index.T, torch.ones_like(index.T, dtype=torch.float64))
    counts = pooled_sum(counts, group)
    at_or_above = counts.flip(1).cumsum(1).flip(1)  # [E, bins]: values in this bin or higher
    bin_index = ((at_or_above >= rank).sum(1) - 1).clamp_min(0)  # the bin holding the rank-th largest value
    above = (at_or_above.gather(1, bin_index[:, None]) - counts.gather(1, bin_index[:, None]))[:, 0]
    inside = counts.gather(1, bin_index[:, None])[:, 0].clamp_min(1)
    fraction = ((rank - above) / inside).clamp(0, 1).to(values.dtype)  # how far down from the bin's upper edge
    return low + width * (bin_index.to(values.dtype) + 1 - fraction)


def quantile_balancing_bias(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, iterations: int, bins: int | None = None, group=None
) -> torch.Tensor:
    """Quantile Balancing: the expert bias that routes about `m * k / E` of the m tokens to every expert.

    scores [m, E] (sigmoid router scores, fp32), bias [E]. One pass: cutoff `c_ij` = the score that expert j
    must beat to enter token i's top-k under the current bias (the (k+1)-th largest of `s_i + b` when j is selected,
    the k-th otherwise), margins `M = s - c`, target load `q = m * k // E`, quantile bias `b*_j = -((q+1)-th largest
    of M[:, j])`, centred to mean 0. Moving every bias at once shifts the cutoffs, so the pass is repeated
    `iterations` times on the same batch, each step going `QUANTILE_STEP` of the way to `b*` (a damped fixed-point
    iteration: undamped steps oscillate around the balanced bias). Each pass is two top-k's, cheap next to experts.
    Under data parallelism (`group`), m counts the tokens of every rank and the quantile is read from pooled
    histograms of `bins` bins (`column_quantile`), so every rank ends with the same bias.
    """
    num_experts = scores.shape[1]
    num_tokens = scores.shape[0]  # on one process from the shape: no host sync per MoE layer and training step
    if group is not None:
        num_tokens = int(pooled_sum(torch.tensor([num_tokens], device=scores.device), group).item())
    target = min(num_tokens * top_k // num_experts, num_tokens - 1)
    for _ in range(iterations):
        ranked = (scores + bias).topk(top_k + 1, dim=-1)
        selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ranked.indices[:, :top_k], True)
        cutoff = torch.where(selected, ranked.values[:, top_k, None], ranked.values[:, top_k - 1, None])
        quantile_bias = -column_quantile(scores - cutoff, target + 1, bins, group)
        bias = bias + QUANTILE_STEP * (quantile_bias - bias)
        bias = bias - bias.mean()
    return bias


# Routers with `router_bias_update="optimizer_step"` holding micro-batch biases, applied after any torch optimizer's step
ROUTERS_AWAITING_STEP: "weakref.WeakSet[KdaMoeRouter]" = weakref.WeakSet()


def apply_biases_after_optimizer_step(optimizer, args, kwargs) -> None:
    for router in list(ROUTERS_AWAITING_STEP):
        router.apply_accumulated_bias()


register_optimizer_step_post_hook(apply_biases_after_optimizer_step)


class KdaMoeRouter(nn.Module):
    """Sigmoid router in fp32 with a selection-only bias (`e_score_correction_bias`, a persistent fp32 buffer).

    Selection uses `sigmoid(W x) + bias` (optionally group-limited); mixing weights are the unbiased scores of the
    chosen experts, renormalised if `moe_renormalize`, times `routed_scaling_factor`.

    Balancing (`router_balancing`): a training forward computes the new bias (`"quantile"`: Quantile Balancing,
    `"bias_sign"`: DeepSeek-V3's `b += gamma * sign(mean_load - load)`) but applies it only once that step's backward
    has gone through the router (a hook on the router logits' gradient). A forward recomputed by gradient
    checkpointing therefore routes exactly like the original one, plain `Trainer` needs no callback, and eval /
    `torch.no_grad()` forwards never touch the bias. The bias never receives gradients. With
    `router_bias_update="optimizer_step"` the backward only adds its bias to a running sum, and the next step of any
    torch optimizer applies the mean: under gradient accumulation every micro-batch of a step routes with the same
    bias (what RL trainers comparing rollout and training log-probabilities need).
    """

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.balancing = config.router_balancing
        self.bias_update_rate = config.router_bias_update_rate
        self.balancing_iterations = config.router_balancing_iterations
        self.balancing_bins = config.router_balancing_bins
        self.backend = config.kernel_backend
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))
        self.last_indices: torch.Tensor | None = None  # the experts the last forward chose [N, k], for `last_load`
        self._pending_bias: torch.Tensor | None = None
        self.bias_update = config.router_bias_update
        self._accumulated_bias: torch.Tensor | None = None  # "optimizer_step": the sum of the micro-batches' biases
        self._accumulated_count = 0
        self.balancing_group = DEFAULT_GROUP  # the ranks whose statistics balancing pools (`set_balancing_group`)

    def forward(
        self, hidden_states: torch.Tensor, input_norm: KdaMoeRMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states [N, d] -> (router_logits [N, E] fp32, topk_weights [N, k] fp32, topk_indices [N, k]), routed
        on `input_norm(hidden_states)` with a norm (applied by the logits kernel where it runs)."""
        # the Triton kernels have no backward, the logits kernel takes a decoding step's tokens and the top-k kernel no
        # expert groups: training, prompts and grouped routing take the reference
        needs_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)
        kernel_logits = hidden_states.shape[0] <= MAX_DECODE_TOKENS and not needs_grad
        hidden_states, input_norm = norm_unless_folded(input_norm, hidden_states, kernels_run=kernel_logits)
        logits = router_logits(
            hidden_states,
            self.weight,
            backend=self.backend if kernel_logits else "torch",
            input_norm=None if input_norm is None else (input_norm.weight, input_norm.variance_epsilon),
        )
        kernel_routes = self.n_group == 1 and not logits.requires_grad
        topk_weights, topk_indices = top_k_routing(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            scale=self.routed_scaling_factor,
            backend=self.backend if kernel_routes else "torch",
        )
        self.last_indices = topk_indices
        if self.balancing != "none" and self.training and torch.is_grad_enabled():
            self._stage_bias_update(logits.detach().sigmoid(), logits)
        return logits, topk_weights, topk_indices

    @property
    def last_load(self) -> torch.Tensor | None:
        """Tokens per expert in the last forward ([E] int64; None before any), counted when asked: a decoding step
        keeps its chosen experts, not three more kernels a sparse layer."""
        return None if self.last_indices is None else expert_loads(self.last_indices, self.num_experts)

    @torch.no_grad()
    def _stage_bias_update(self, scores: torch.Tensor, router_logits: torch.Tensor) -> None:
        group = data_parallel_group(self.balancing_group)
        if self.balancing == "quantile":
            new_bias = quantile_balancing_bias(
                scores,
                self.e_score_correction_bias,
                self.top_k,
                self.balancing_iterations,
                bins=None if group is None else self.balancing_bins,
                group=group,
            )
        else:  # "bias_sign"
            load = pooled_sum(self.last_load.float(), group)
            new_bias = self.e_score_correction_bias + self.bias_update_rate * torch.sign(load.mean() - load)
        self._pending_bias = new_bias
        if router_logits.requires_grad:
            router_logits.register_hook(self._apply_pending_bias)
        else:  # no backward will reach this router (everything before it is frozen): nothing can recompute it
            self._apply_pending_bias()

    @torch.no_grad()
    def _apply_pending_bias(self, grad: torch.Tensor | None = None) -> None:
        """The staged bias becomes the bias (`"backward"`) or joins the running sum of the optimizer step."""
        if self._pending_bias is None:
            return
        if self.bias_update == "optimizer_step":
            if self._accumulated_bias is None:
                self._accumulated_bias = self._pending_bias
            else:
                self._accumulated_bias = self._accumulated_bias + self._pending_bias
            self._accumulated_count += 1
            ROUTERS_AWAITING_STEP.add(self)
        else:
            self.e_score_correction_bias.copy_(self._pending_bias)
        self._pending_bias = None

    @torch.no_grad()
    def apply_accumulated_bias(self) -> None:
        """The mean of the biases of the micro-batches since the last optimizer step becomes the bias."""
        if self._accumulated_bias is not None:
            self.e_score_correction_bias.copy_(self._accumulated_bias / self._accumulated_count)
            self._accumulated_bias, self._accumulated_count = None, 0
        ROUTERS_AWAITING_STEP.discard(self)

    def load_statistics(self) -> dict[str, float]:
        """Max / mean tokens per expert and the number of experts that got no token, in the last forward."""
        load = self.last_load.float()
        return {"max_load": load.max().item(), "mean_load": load.mean().item(), "dead_experts": int((load == 0).sum())}


# ----------------------------------------------------------------------------------------------------------------
# Routed experts (fused 3D weights) and the LatentMoE block
# ----------------------------------------------------------------------------------------------------------------


# transformers' implementations of plain fused weights, which compute what our expert kernels compute
PLAIN_EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def with_expert_kernels(experts_class: type[nn.Module]) -> type[nn.Module]:
    """Class decorator over `@use_experts_implementation`: a call that `takes_decode_kernel` runs `moe_decode`'s
    Triton kernel, one that `takes_grouped_kernel` runs `grouped_experts`' Triton path, any other
    `config.experts_implementation`'s forward. Experts kept mxfp4 run `grouped_experts`' Triton path where the kernel
    backend resolves to Triton, else the eager loop over weights decoded for the call (`forward_packed`), whatever
    `config.experts_implementation` says. The choice is made inside the module call, so hooks on the experts module
    (tensor / expert parallel plans, output recorders) run around either."""
    implementation_forward = experts_class.forward

    @wraps(implementation_forward)
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.is_mxfp4:
            return self.forward_packed(hidden_states, top_k_index, top_k_weights)
        if self.takes_decode_kernel(hidden_states):
            expert_kernel = moe_decode
        elif self.takes_grouped_kernel(hidden_states):
            expert_kernel = grouped_experts
        else:
            return implementation_forward(self, hidden_states, top_k_index, top_k_weights)
        return expert_kernel(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
            **self.act_fn.kernel_options(), backend="triton",
        )

    experts_class.forward = forward
    return experts_class


@with_expert_kernels
@use_experts_implementation
class KdaMoeExperts(nn.Module):
    """E routed experts stored fused: `gate_up_proj` [E, 2I, l] and `down_proj` [E, l, I] (l = expert width); with
    `config.routed_expert_format="mxfp4"`, the same rows packed as uint8 (`[E, 2I, l / 2 + l / 32]`, `[E, l, I / 2 +
    I / 32]`: 4.25 bits a weight), which only `forward_packed` reads.

    `config.experts_implementation` picks this eager loop or transformers' batched / grouped GEMMs; all of them call
    `_apply_gate`, so SiTU-GLU is used everywhere. On the Triton backend two of our kernels take over: decoding (a few
    tokens, no autograd) runs `moe_decode`, one kernel that reads only the chosen experts' weights, each once
    (`takes_decode_kernel`); `"grouped_mm"` for more tokens, with or without autograd (and `"batched_mm"` without),
    runs `grouped_experts`, grouped GEMMs with the activation and the routing weights in one kernel between them
    (`takes_grouped_kernel`).
    """

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.routed_expert_hidden_size or config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.is_mxfp4 = config.routed_expert_format == "mxfp4"
        E, I, l = self.num_experts, self.intermediate_dim, self.hidden_dim
        if self.is_mxfp4:  # frozen bytes: each row's packed E2M1 values, then its E8M0 scales (`Mxfp4Weight.from_rows`)
            gate_up_bytes = torch.zeros(E, 2 * I, mxfp4_row_bytes(l), dtype=torch.uint8)
            self.gate_up_proj = nn.Parameter(gate_up_bytes, requires_grad=False)
            self.down_proj = nn.Parameter(torch.zeros(E, l, mxfp4_row_bytes(I), dtype=torch.uint8), requires_grad=False)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, l))
            self.down_proj = nn.Parameter(torch.empty(E, l, I))
        self.act_fn = KdaMoeGatedActivation(config)
        self.backend = config.kernel_backend

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate, up)

    def check_whole_packed_experts(self) -> None:
        """Experts kept mxfp4 run as one device's whole set of frozen bytes (`holds_every_expert_whole`): an adapter
        on the weights (PEFT's expert LoRA parametrizes them) or a parallel layout would need dense weights."""
        if parametrize.is_parametrized(self):
            raise ValueError(
                "Routed experts kept mxfp4 (routed_expert_format='mxfp4') are frozen bytes and take no adapter; load "
                "the model with routed_expert_format='dense' to put LoRA on the experts, or target other modules."
            )
        if not self.holds_every_expert_whole():
            raise ValueError(
                "Routed experts kept mxfp4 (routed_expert_format='mxfp4') run whole on each device; expert and tensor "
                "parallelism need them dense: load the model with routed_expert_format='dense'."
            )

    def takes_decode_kernel(self, hidden_states: torch.Tensor) -> bool:
        """Whether this call runs `moe_decode`'s Triton kernel: at most `MAX_DECODE_TOKENS` tokens and no gradient
        needed; the weights as built (not parametrized, as an active PEFT adapter on them is; holding all E experts,
        not an expert-parallel shard) under one of transformers' implementations for plain weights; and the kernel
        backend resolving to Triton for these tensors. Everything else keeps `config.experts_implementation`."""
        weights = (self.gate_up_proj, self.down_proj)
        if (
            (torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, *weights)))
            or parametrize.is_parametrized(self)
            or not self.holds_every_expert_whole()
            or self.config._experts_implementation not in PLAIN_EXPERTS_IMPLEMENTATIONS
            or not fits_decode_kernel(hidden_states, *weights)  # at most MAX_DECODE_TOKENS tokens, matching dtypes
        ):
            return False
        return resolve_backend(self.backend, hidden_states, *weights) == "triton"

    def takes_grouped_kernel(self, hidden_states: torch.Tensor) -> bool:
        """Whether this call runs `grouped_experts`' Triton path: `config.experts_implementation == "grouped_mm"`, or
        `"batched_mm"` in a call without autograd (generate() switches grouped_mm to batched_mm while decoding, whose
        per-token weight gathers read an expert once for every token that picks it: past the decode kernel's token
        count the grouped path, which reads each once, computes the same thing) that is eager or has bf16 weights
        (compiled, other dtypes take transformers' per-expert fallback GEMM, which reads the group sizes on the host:
        no CUDA graph could hold it); weights that hold all E experts as plain tensors (`holds_every_expert_whole`);
        and the kernel backend resolving to Triton for these tensors."""
        implementation = self.config._experts_implementation
        graph_safe = not torch.compiler.is_compiling() or self.gate_up_proj.dtype == torch.bfloat16
        decoding = implementation == "batched_mm" and not torch.is_grad_enabled() and graph_safe
        grouped = implementation == "grouped_mm" or decoding
        if not grouped or not self.holds_every_expert_whole():
            return False
        return resolve_backend(self.backend, hidden_states, self.gate_up_proj, self.down_proj) == "triton"

    def holds_every_expert_whole(self) -> bool:
        """All E experts, as plain tensors: not an expert-parallel shard (whose routes to other ranks carry an id past
        its experts: a shard's shape up to transformers 5.18, `_is_expert_parallel` from 5.19), nor tensor-parallel
        DTensors. Our kernels take only these."""
        return (
            self.gate_up_proj.shape[0] == self.num_experts
            and not getattr(self, "_is_expert_parallel", False)
            and not any(isinstance(weight, DTensor) for weight in (self.gate_up_proj, self.down_proj))
        )

    def forward_packed(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Experts kept mxfp4: `grouped_experts`' Triton path, whose GEMMs decode the weights in registers, or (the
        backend resolving to torch) the eager loop over the weights decoded for this call in the states' dtype."""
        self.check_whole_packed_experts()
        packed = (Mxfp4Weight.from_rows(self.gate_up_proj), Mxfp4Weight.from_rows(self.down_proj))
        if resolve_backend(self.backend, hidden_states, self.gate_up_proj, self.down_proj) == "triton":
            return grouped_experts(
                hidden_states, top_k_index, top_k_weights, *packed, **self.act_fn.kernel_options(), backend="triton",
            )
        decoded = (dequantize_mxfp4(*weight, hidden_states.dtype) for weight in packed)
        return self.loop_over_experts(hidden_states, top_k_index, top_k_weights, *decoded)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [N, l], top_k_index / top_k_weights [N, k] -> [N, l].

        The loop visits the experts that got tokens, which it reads on the host; compiled code takes transformers'
        `batched_mm` instead (each token through its k experts' gathered weights: the same function, fixed shapes).
        """
        if torch.compiler.is_compiling():
            return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        return self.loop_over_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    def loop_over_experts(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
    ) -> torch.Tensor:
        """The eager loop over the experts that got tokens (read on the host), with weights [E, 2I, l] / [E, l, I]."""
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # Under expert parallelism `num_experts` counts this rank's experts, and the routes to other ranks' experts
            # carry the id `num_experts` (weight 0): they get a counter of their own, which is never visited.
            expert_hit = expert_loads(top_k_index, self.num_experts + 1)[:-1].nonzero().flatten().tolist()
        for expert_idx in expert_hit:
            token_idx, top_k_pos = torch.where(top_k_index == expert_idx)
            gate_up = F.linear(hidden_states[token_idx], gate_up_proj[expert_idx])
            expert_out = F.linear(self._apply_gate(gate_up), down_proj[expert_idx])
            expert_out = expert_out * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, expert_out.to(final_hidden_states.dtype))
        return final_hidden_states


class KdaMoeSparseMoeBlock(nn.Module):
    """LatentMoE: route on the full hidden state, run the experts in a narrower latent space.

    `z = latent_down_proj(x)`; `u = sum_j w_j Expert_j(z)`; `u = latent_norm(u)`; `y = latent_up_proj(u) +
    shared_experts(x)`. With `routed_expert_hidden_size=None` the experts run at full width (no latent path), and a
    decoding step on Triton runs the router and the experts, the shared expert among them, as one `moe_decode` call
    (`decodes_in_one_call`).
    """

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__()
        self.gate = KdaMoeRouter(config)
        self.experts = KdaMoeExperts(config)
        latent = config.routed_expert_hidden_size
        self.latent_down_proj = nn.Linear(config.hidden_size, latent, bias=False) if latent else None
        self.latent_up_proj = nn.Linear(latent, config.hidden_size, bias=False) if latent else None
        self.latent_norm = KdaMoeRMSNorm(latent, eps=config.rms_norm_eps) if latent and config.latent_moe_use_norm else None
        self.shared_experts = (
            KdaMoeMLP(config, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )

    def decodes_in_one_call(self, tokens: torch.Tensor) -> bool:
        """Whether the router and one `moe_decode` call run the whole block: no latent projection, routed experts
        that `takes_decode_kernel` and, if any, a shared expert of plain linears (`is_plain_linear`) whose weights the
        kernel takes (its output joins the same sums) and no gradient needs; the router, the experts and the shared
        expert `runs_its_own_forward`. The kernels then add the residual themselves, and apply the input norm where
        they fold it (`kernel_folds_norm`)."""
        shared, experts = self.shared_experts, self.experts
        return (
            self.latent_down_proj is None
            and not experts.is_mxfp4
            and runs_its_own_forward(experts)
            and runs_its_own_forward(self.gate)
            and experts.takes_decode_kernel(tokens)
            and (
                shared is None
                or runs_its_own_forward(shared)
                and all(is_plain_linear(linear) for linear in (shared.gate_proj, shared.up_proj, shared.down_proj))
                and fits_decode_kernel(tokens, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
                and not (torch.is_grad_enabled() and any(weight.requires_grad for weight in shared.parameters()))
            )
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_norm: KdaMoeRMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + LatentMoE(input_norm(hidden_states))`; without `input_norm` / `residual` the input as it is
        and the output alone."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.decodes_in_one_call(tokens):
            tokens, input_norm = norm_unless_folded(input_norm, tokens)
            experts, shared = self.experts, self.shared_experts
            norm = None if input_norm is None else (input_norm.weight, input_norm.variance_epsilon)
            _, topk_weights, topk_indices = self.gate(tokens, input_norm=input_norm)
            output = moe_decode(  # the routing weights stay fp32: the kernel multiplies in fp32
                tokens, topk_indices, topk_weights, experts.gate_up_proj, experts.down_proj,
                **experts.act_fn.kernel_options(),
                shared=None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight,
                                                    shared.down_proj.weight),
                input_norm=norm, residual=None if residual is None else residual.reshape(tokens.shape),
                backend="triton",
            )
            return output.view(shape)
        if input_norm is not None:
            tokens = input_norm(tokens)
        _, topk_weights, topk_indices = self.gate(tokens)
        latent = tokens if self.latent_down_proj is None else self.latent_down_proj(tokens)
        routed = self.experts(latent, topk_indices, topk_weights.to(latent.dtype))
        if self.latent_norm is not None:
            routed = self.latent_norm(routed)
        output = routed if self.latent_up_proj is None else self.latent_up_proj(routed)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        output = output.view(shape)
        return output if residual is None else residual + output


# ----------------------------------------------------------------------------------------------------------------
# Block Attention Residuals
# ----------------------------------------------------------------------------------------------------------------


class KdaMoePseudoQuery(nn.Linear):
    """`Linear(d, 1)` holding an AttnRes pseudo-query; its own class so that init can start it at zero."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1, bias=False)


class KdaMoeAttnRes(nn.Module):
    """Softmax mixture over depth of the stored block summaries and the running partial sum.

    `w = norm.weight * proj.weight` is the effective pseudo-query (zero at init: uniform mixing); keys are the
    RMS-normalised values, the mixture is taken over the raw values, all in fp32, also under autocast: a bf16
    `keys @ query` makes a row's mixture depend on where the row sits in the batch, which RL trainers that re-order
    rows between rollout and training see as an importance ratio != 1. `attn_res_mix` computes it: a fused Triton
    kernel or the PyTorch reference, as `config.kernel_backend` picks.
    """

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__()
        self.proj = KdaMoePseudoQuery(config.hidden_size)
        self.norm = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.backend = config.kernel_backend

    def forward(self, partial: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
        """partial [B, T, d], blocks [N, B, T, d] or None -> [B, T, d]."""
        if blocks is None:
            return partial
        # the context is entered only under autocast: at decoding sizes it costs as much as the mix itself
        if torch.is_autocast_enabled(partial.device.type):
            with torch.autocast(partial.device.type, enabled=False):
                return self.mix(partial, blocks)
        return self.mix(partial, blocks)

    def mix(self, partial: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        with onloaded_weights(self.norm, self.proj):
            # plain tensors here also where a parametrization computes a weight or an adapter wraps the module
            norm_weight, query_weight = self.norm.weight, self.proj.weight[0]  # [d] each
            return attn_res_mix(partial, blocks, norm_weight, query_weight, self.norm.variance_epsilon, self.backend)


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeAttentionWeights(nn.Module):
    """Passes a layer's attention weights through: the module whose outputs `output_attentions` records, so there is
    one entry per layer (KDA layers pass None: they have no attention weights) and the index is the layer number."""

    def forward(self, attn_weights: torch.Tensor | None) -> torch.Tensor | None:
        return attn_weights


class KdaMoeDecoderLayer(GradientCheckpointingLayer):
    """Token mixer (KDA or gated MLA) and channel mixer (dense MLP or LatentMoE), pre-norm.

    The layer carries `(partial, blocks)`: with plain residuals `partial` is the residual stream and `blocks` stays
    None; with Block AttnRes each sublayer reads a depth mixture of the stored blocks and the partial sum, and a new
    block starts every `attn_res_block_size` layers (the embedding, stored by the model, is the first). It returns
    `(partial, started)`: `started` is the stored blocks with this layer's input appended where a later block starts
    here, else None (the caller keeps its blocks: a layer never returns its input, which FSDP2 would see as a view).
    """

    def __init__(self, config: KdaMoeTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.self_attn = KdaMoeDeltaAttention(config, layer_idx)
        else:
            self.self_attn = KdaMoeAttention(config, layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = KdaMoeSparseMoeBlock(config)
        else:
            self.mlp = KdaMoeMLP(config, config.intermediate_size)
        self.attention_weights = KdaMoeAttentionWeights()
        self.input_layernorm = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        block_size = config.attn_res_block_size
        self.starts_block = block_size is not None and layer_idx % block_size == 0
        # Layer 0 reads the embedding itself (no stored block yet), so it has no attention-input mixture.
        self.attn_res = KdaMoeAttnRes(config) if block_size is not None and layer_idx > 0 else None
        self.mlp_res = KdaMoeAttnRes(config) if block_size is not None else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attn_res_blocks: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        sequence_shard=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        partial, blocks = hidden_states, attn_res_blocks
        mixed = partial if self.attn_res is None else self.attn_res(partial, blocks)
        started = None
        if self.starts_block and self.layer_idx > 0:  # the first block, the embedding, is stored by the model
            blocks = started = torch.cat([blocks, partial[None]], dim=0)

        # each sublayer applies its input norm and adds its output to the residual it is given: a decoding step's
        # kernels do both as they read and write the rows, with no kernel between two sublayers
        token_mixer_inputs = dict(
            attention_mask=attention_mask,
            cache=cache,
            sequence_shard=sequence_shard,
            input_norm=self.input_layernorm,
            residual=None if self.starts_block else partial,
        )
        if self.layer_type == "linear_attention":
            partial = self.self_attn(mixed, cu_seqlens=cu_seqlens, **token_mixer_inputs)
            attn_weights = None
        else:
            partial, attn_weights = self.self_attn(
                mixed, position_embeddings=position_embeddings, **token_mixer_inputs, **kwargs
            )
        self.attention_weights(attn_weights)

        mixed = partial if self.mlp_res is None else self.mlp_res(partial, blocks)
        partial = self.mlp(mixed, input_norm=self.post_attention_layernorm, residual=partial)
        return partial, started


# ----------------------------------------------------------------------------------------------------------------
# Pretrained model, base model, causal LM head
# ----------------------------------------------------------------------------------------------------------------


class KdaMoePreTrainedModel(PreTrainedModel):
    config: KdaMoeTextConfig
    config_class = KdaMoeTextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KdaMoeDecoderLayer"]
    # arguments accelerate's device hooks leave where they are: the caches, and the RMSNorm module a decoder layer
    # hands its sublayers (moving a module moves its weights, which offloading keeps on the meta device)
    _skip_keys_device_placement = ["past_key_values", "cache", "input_norm"]
    _supports_flash_attn = False  # MLA's query/key width differs from the value width
    _supports_sdpa = True
    _supports_flex_attn = False
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(KdaMoeRouter, index=0),
        "hidden_states": OutputRecorder(KdaMoeDecoderLayer, index=0),
        "attentions": OutputRecorder(KdaMoeAttentionWeights),
    }
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "dt_bias", "A_log"]
    # The checkpoint conversions `save_pretrained` undoes: `from_pretrained` sets those it applied; a model built in
    # memory has none, so it saves our layout (see `conversion.py`).
    _weight_conversions = ()
    # The K3 checkpoint stores an AttnRes pseudo-query for layer 0, whose input is the embedding alone (no mix).
    _keys_to_ignore_on_load_unexpected = [r"layers\.0\.attn_res\."]

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """generate()'s default cache is a `KdaMoeCache` (transformers would build a `DynamicCache`); for assisted
        and prompt-lookup decoding it records the states of the drafted tokens, so `crop` can roll KDA layers back.
        `cache_implementation="static"` builds a `KdaMoeStaticCache` (`_prepare_static_cache`); for greedy decoding
        in CUDA-graph blocks (`decode_steps_per_graph`, see `_sample`) one a block longer, so that a block may run past
        the last token, or the cache of the model's `GraphedDecoder` again, reset, so that its graph is replayed."""
        uses_cache = model_kwargs.get(CACHE_NAME) is None and generation_config.use_cache is not False
        steps_per_graph = decode_steps_per_graph(generation_config, self.device)
        if uses_cache and generation_config.cache_implementation in (None, "dynamic"):
            model_kwargs[CACHE_NAME] = KdaMoeCache(self.config)
        elif (
            uses_cache
            and generation_config.cache_implementation == "static"
            and steps_per_graph is not None
            and generation_mode == GenerationMode.GREEDY_SEARCH
            and not generation_config.return_dict_in_generate  # a returned cache is never handed out again
            and self.on_one_device()
            and len(args) == 2
        ):
            batch_size, max_cache_length = args
            length = max(max_cache_length, generation_config.max_cache_len or 0) + steps_per_graph
            model_kwargs[CACHE_NAME] = self._graphed_decoding_cache(batch_size, length)
        else:
            super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        cache = model_kwargs.get(CACHE_NAME)
        if generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant:
            if not isinstance(cache, KdaMoeCache):
                raise ValueError(
                    f"Assisted and prompt-lookup decoding roll KDA states back, which needs a KdaMoeCache, got a "
                    f"{type(cache).__name__}. Pass `{CACHE_NAME}=KdaMoeCache(model.config)`, or no cache and no "
                    "`cache_implementation` (a static cache keeps only the current KDA states)."
                )
            drafted = generation_config.prompt_lookup_num_tokens or generation_config.num_assistant_tokens
            cache.activate_past_recording(recurrent_states_to_keep=drafted)

    def on_one_device(self) -> bool:
        """Whether the whole model is on one device (not spread by a `device_map` over several)."""
        return len(set(getattr(self, "hf_device_map", {}).values())) <= 1

    def _graphed_decoding_cache(self, batch_size: int, length: int) -> "KdaMoeStaticCache":
        """The static cache of the model's `GraphedDecoder`, reset, where it fits `batch_size` sequences of `length`
        tokens in the model's dtype and device; else a new one."""
        decoder = self.__dict__.get("_graphed_decoder")
        if decoder is not None and decoder.fits(batch_size, length, self.dtype, self.device):
            decoder.cache.reset()
            return decoder.cache
        return self._prepare_static_cache("static", batch_size, length)

    def _prepare_static_cache(self, cache_implementation: str, batch_size: int, max_cache_len: int, *args, **kwargs):
        """The cache of `cache_implementation="static"` (and `"offloaded_static"`, which moves MLA latents to the CPU
        between layers): a `KdaMoeStaticCache`, allocated here unless the model is spread over several devices (then
        each layer allocates on its own device at the prefill). Like transformers, it is never shorter than the last
        one this model built, so a later generate() call reuses the compiled decode step instead of recompiling."""
        max_cache_len = max(max_cache_len, getattr(self, "_previous_max_cache_length", -1))
        self._previous_max_cache_length = max_cache_len
        return KdaMoeStaticCache(
            self.config,
            max_cache_len=max_cache_len,
            batch_size=batch_size if self.on_one_device() else None,
            dtype=self.dtype,
            device=self.device,
            offloading="offloaded" in cache_implementation,
        )

    def _default_compile_config(self) -> CompileConfig:
        """transformers' compile settings for the decode step (inductor, and on CUDA `"reduce-overhead"`: CUDA graphs),
        with `fullgraph=True`: the one-token forward on a static cache has no graph break."""
        compile_config = super()._default_compile_config()
        compile_config.fullgraph = True
        return compile_config

    def init_continuous_batching(self, *args, **kwargs):
        """Refused: transformers' continuous batching (`generate_batch`, `cache_implementation="paged"`) pages
        attention keys and values, and has no place for the recurrent state of KDA layers."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support continuous batching (`generate_batch`, "
            "`init_continuous_batching`, `cache_implementation='paged'`): its paged cache holds attention keys and "
            "values only, not the recurrent state of KDA layers. Call `generate()` on a padded batch instead, e.g. "
            "`model.generate(**tokenizer(prompts, padding=True, padding_side='left', return_tensors='pt'))`."
        )

    def __init__(self, config, *inputs, **kwargs):
        config.validate()  # the rules relating fields: an edit after the config was built is checked here
        super().__init__(config, *inputs, **kwargs)

    def _init_weights(self, module):
        if isinstance(module, KdaMoePseudoQuery):
            init.zeros_(module.weight)  # zero pseudo-queries: every AttnRes mixture starts as the plain average
            return
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, KdaMoeDeltaAttention):
            # Decay rates exp(A_log) in [1, 16]; dt_bias = inverse softplus of dt ~ logU(1e-3, 1e-1), as in Mamba/FLA.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, KdaMoeExperts):
            for weight in (module.gate_up_proj, module.down_proj):
                if module.is_mxfp4:  # packed bytes start at 0 (every value 0): they are loaded, never trained
                    init.zeros_(weight)
                else:
                    init.normal_(weight, mean=0.0, std=std)
        elif isinstance(module, KdaMoeRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KdaMoeGatedRMSNorm):
            init.ones_(module.weight)

    def _remote_code_classes(self) -> dict[str, type]:
        """The classes a saved folder's `auto_map` names; `save_pretrained` writes their source into the folder."""
        return {"AutoConfig": KdaMoeTextConfig, "AutoModel": KdaMoeTextModel, "AutoModelForCausalLM": KdaMoeForCausalLM}

    def save_pretrained(
        self, save_directory, *args, layout: str | None = None, quantize_experts: str | None = None, **kwargs
    ):
        """`PreTrainedModel.save_pretrained` in a checkpoint layout: weight names and `config.json` spelling both.

        Args:
            layout: `"kda_moe"` (ours), `"kimi_linear"` (what transformers' `KimiLinearForCausalLM`, the published
                remote code and serving engines read; text models without K3's features) or `"kimi_k3"` (the
                published Kimi K3 layout; multimodal models). Default: the layout the model was loaded from (ours for
                a model built in memory, and with `save_original_format=False`), with exactly the weight names it
                was loaded with.
            quantize_experts: `"mxfp4"` packs the routed experts as the K3 release stores them (compressed-tensors'
                `mxfp4-pack-quantized`, with its `quantization_config`); default: dense, in the model's dtype. Experts
                kept mxfp4 (`routed_expert_format="mxfp4"`) are written packed, byte for byte.

        The weights go through the reverse of the layout's conversions (`conversion.layout_conversions`). Ours also
        gets the package source the folder runs (flattened, named by `config.auto_map`:
        `Auto*.from_pretrained(folder, trust_remote_code=True)` loads it where kda_moe is not installed; see
        `remote_code.py`) and the model card (`README.md`, kept if someone else wrote it); a published layout gets
        neither, as its readers bring their own code.
        """
        original_format = kwargs.get("save_original_format", True)
        if not original_format and layout not in (None, "kda_moe"):
            raise ValueError(f"save_original_format=False writes our layout; drop it to write layout={layout!r}.")
        as_loaded = layout is None and quantize_experts is None
        if layout is None:
            layout = checkpoint_layout(self) if original_format else "kda_moe"
        if self.config.get_text_config().routed_expert_format == "mxfp4" and layout != "kda_moe":
            if layout == "kimi_linear":
                raise ValueError(
                    "This model keeps its routed experts mxfp4 (routed_expert_format='mxfp4'), which the kimi_linear "
                    "layout cannot store; write layout='kimi_k3' (mxfp4 experts) or 'kda_moe', or load the model with "
                    "routed_expert_format='dense'."
                )
            as_loaded = False
            quantize_experts = quantize_experts or "mxfp4"  # the experts' packed bytes, written as they are
        # as loaded: the very conversions loading applied (transformers' in-memory Kimi Linear names included)
        conversions = self._weight_conversions if as_loaded else layout_conversions(self, layout, quantize_experts)
        published_config = layout_config_dict(self, layout, quantize_experts)  # raises before anything is written
        if published_config is not None and kwargs.get("push_to_hub"):
            raise ValueError(
                f"push_to_hub=True uploads before the {layout} config.json is written; save the folder, then upload it "
                "with `huggingface_hub.upload_folder`."
            )
        is_main_process = kwargs.get("is_main_process", True)
        if is_main_process and published_config is None:
            self.config.auto_map = write_remote_code(save_directory, self._remote_code_classes())
            write_model_card(self, save_directory)
        loaded_conversions = self.__dict__.get("_weight_conversions")
        self._weight_conversions = conversions
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            if loaded_conversions is None:
                del self._weight_conversions
            else:
                self._weight_conversions = loaded_conversions
        if is_main_process and published_config is not None:
            published_config = layout_config_dict(self, layout, quantize_experts)  # with the dtype saving recorded
            with open(os.path.join(save_directory, CONFIG_NAME), "w", encoding="utf-8") as handle:
                handle.write(json.dumps(published_config, indent=2, sort_keys=True) + "\n")

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        """`PushToHubMixin._upload_modified_files`, after putting our model card back: both `push_to_hub` and
        `save_pretrained(..., push_to_hub=True)` save transformers' card (the Hub's, or a generic one, from
        `create_and_tag_model_card`) as `working_dir/README.md` just before they call this. The push's tags are kept,
        and so is a card someone wrote on the Hub (see `model_cards.write_pushed_model_card`)."""
        write_pushed_model_card(self, working_dir, repo_id)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, *args, **kwargs):
        """transformers' tensor / expert / FSDP layout of `from_pretrained(..., distributed_config=...)` (or
        `tp_plan=`), after which expert balancing pools its statistics over the mesh's data-parallel ranks only: the
        ranks of one tensor-parallel group route the same tokens, and pooling over them would count each token once
        per rank. Layouts this transformers cannot load are refused first, with the sizes that work."""
        check_fsdp_with_tensor_parallel(distributed_config)
        model = super().maybe_distribute_model(model, distributed_config, *args, **kwargs)
        if getattr(model, "_device_mesh", None) is not None:
            check_shards_load(model)
            model.set_balancing_group(data_parallel_group_of_mesh(model))
        return model

    def set_balancing_group(self, group) -> None:
        """Make every router pool its balancing statistics (Quantile Balancing's margin histograms, `"bias_sign"`'s
        loads) over `group`: the process group of the ranks that hold different tokens, None for none (one process,
        or every rank routes the same tokens). Without a call the default group is used, as plain DDP / FSDP need."""
        for module in self.modules():
            if isinstance(module, KdaMoeRouter):
                module.balancing_group = group

    def router_load_statistics(self) -> dict[str, dict[str, float]]:
        """Per MoE layer load statistics of the last forward (max/mean tokens per expert, dead experts)."""
        return {
            name.removesuffix(".gate"): module.load_statistics()
            for name, module in self.named_modules()
            if isinstance(module, KdaMoeRouter) and module.last_indices is not None
        }


def check_batch_shape(name: str, tensor: torch.Tensor, shape: str) -> None:
    """Refuse a `tensor` that is not `shape` (its text, e.g. "[batch, seq_len]") or whose batch or sequence is empty."""
    ndim = shape.count(",") + 1
    if tensor.ndim != ndim:
        hint = f"; for a single sequence pass `{name}[None]`" if tensor.ndim == ndim - 1 else ""
        raise ValueError(f"`{name}` must be {shape}, got shape {tuple(tensor.shape)}{hint}.")
    if tensor.shape[0] == 0:
        raise ValueError(f"`{name}` holds an empty batch (shape {tuple(tensor.shape)}); pass at least one sequence.")
    if tensor.shape[1] == 0:
        raise ValueError(f"`{name}` holds no tokens (shape {tuple(tensor.shape)}); pass one or more per sequence.")


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse `input_ids` the embedding cannot look up: not [batch, seq_len] integers, empty, or outside
    [0, vocab_size). The range check reads the ids' min and max on the host, so it is skipped while tracing
    (torch.compile, CUDA-graph capture)."""
    check_batch_shape("input_ids", input_ids, "[batch, seq_len]")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"`input_ids` must hold integer token ids, got dtype {input_ids.dtype}; pass `.long()` ids.")
    if is_tracing(input_ids):
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"`input_ids` hold ids in [{low}, {high}], but token ids must lie in [0, vocab_size={vocab_size}). Use "
            "the tokenizer that belongs to the model, or grow the model to the tokenizer with "
            "`model.resize_token_embeddings(len(tokenizer))`."
        )


def check_attention_mask(
    attention_mask: torch.Tensor | dict | None, batch_size: int, new_tokens: int, cached: int | None
) -> None:
    """Refuse a 2-D `attention_mask` that is not [batch, cached + new tokens]: KDA layers read its last `new_tokens`
    entries and MLA layers its first ones, so any other length would mask the two kinds of layers differently.

    4-D masks and transformers' per-layer-type mask dicts pass as they are. `cached`: the tokens the cache holds (0
    without a cache), or None where they are not counted (while tracing, or a pure-KDA cache on transformers 5.17):
    then the mask only needs to cover the new tokens.
    """
    if attention_mask is None or isinstance(attention_mask, dict) or attention_mask.ndim == 4:
        return
    expected = f"[batch, cached + new tokens] = [{batch_size}, {'cached' if cached is None else cached} + {new_tokens}]"
    if attention_mask.ndim != 2:
        raise ValueError(f"`attention_mask` must be {expected} (or 4-D), got shape {tuple(attention_mask.shape)}.")
    length = attention_mask.shape[1]
    wrong_length = length < new_tokens if cached is None else length != cached + new_tokens
    if attention_mask.shape[0] != batch_size or wrong_length:
        raise ValueError(
            f"`attention_mask` has shape {tuple(attention_mask.shape)}, but this forward needs {expected}: one row "
            "per sequence, with an entry for every cached token and every new one (as generate() passes it). Pass "
            "a mask of that shape, or none."
        )


def check_cache_room(cache: StaticCache, new_tokens: int, cached: int | None) -> None:
    """Refuse new tokens that a static cache holding `cached` tokens (None: not counted) has no room for in its MLA
    layers."""
    room = cache.get_max_length()  # -1 without MLA layers: KDA states hold any number of tokens
    if room >= 0 and cached is not None and cached + new_tokens > room:
        raise ValueError(
            f"The cache holds {cached} tokens of at most {room} (its `max_cache_len`): no room for {new_tokens} more. "
            "Size a static cache for the whole sequence (`generate(..., cache_implementation=\"static\", "
            "max_cache_len=N)` or `KdaMoeStaticCache(model.config, max_cache_len=N)`), or use the dynamic cache."
        )


def check_text_inputs(
    config: KdaMoeTextConfig,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | dict | None,
    cache: Cache | None,
) -> None:
    """The text model's input checks, run once per forward before anything is computed: inputs that would fail deep
    inside a layer, or be read differently by KDA and MLA layers, raise a `ValueError` that names the fix."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        check_input_ids(input_ids, config.vocab_size)
    else:
        check_batch_shape("inputs_embeds", inputs_embeds, "[batch, seq_len, hidden_size]")
        if inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(
                f"`inputs_embeds` must be [batch, seq_len, hidden_size={config.hidden_size}], got shape "
                f"{tuple(inputs_embeds.shape)}; build them with `model.get_input_embeddings()(input_ids)`."
            )
    tokens = input_ids if input_ids is not None else inputs_embeds
    batch_size, new_tokens = tokens.shape[:2]
    # counting a static cache's tokens reads a tensor on the host: once per forward, and never while tracing
    cached = 0 if cache is None else None if is_tracing(tokens) else cached_token_count(cache)
    check_attention_mask(attention_mask, batch_size, new_tokens, cached)
    if isinstance(cache, StaticCache):
        check_cache_room(cache, new_tokens, cached)


def packed_sequence_boundaries(position_ids: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
    """`cu_seqlens` of a packed batch (one row whose position ids restart at 0 for every sequence), else None."""
    if position_ids is None or batch_size != 1 or position_ids.shape[-1] < 2:
        return None
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    if starts.numel() <= 1 or starts[0] != 0:
        return None
    end = torch.tensor([position_ids.shape[-1]], device=starts.device)
    return torch.cat([starts, end]).to(torch.int64)


# attention implementations whose mask `static_cache_causal_mask` builds: SDPA's boolean one, eager's additive one
STATIC_MASKS = ("sdpa", "eager")


def static_cache_causal_mask(
    attention_mask: torch.Tensor, cache: "KdaMoeStaticCache", new_tokens: int, dtype: torch.dtype, additive: bool
) -> torch.Tensor:
    """MLA layers' mask over a static cache's `S = max_cache_len` positions, [B, 1, T, S], from the 2-D padding mask
    [B, L] of the cached and the `T` new tokens: new token t, held at position L - T + t, sees position s when
    s <= L - T + t and the padding mask keeps s. The mask transformers' `create_causal_mask` gives a static cache,
    from the mask's shape alone (no read of the cache's token count), in a few tensor operations: generate() builds
    one outside the compiled step at every token, so its host time is part of every step."""
    length, size = attention_mask.shape[1], cache.get_max_length()
    keep = F.pad(attention_mask.bool(), (0, size - length))[:, None, None, :]  # [B, 1, 1, S]
    positions = torch.arange(size, device=attention_mask.device)
    newest = torch.arange(length - new_tokens, length, device=attention_mask.device)[:, None]  # [T, 1]
    visible = keep & (positions <= newest)  # [B, 1, T, S]
    if not additive:
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


def lower_right_causal_bias(
    config: KdaMoeTextConfig, attention_mask: torch.Tensor | None, cache: Cache | None, new_tokens: int
) -> LowerRightCausalBias | None:
    """MLA layers' mask under SDPA where no tensor is needed: `new_tokens` > 1 continue a dynamic cache that already
    holds tokens (a prefill chunk) and nothing is padded. `create_causal_mask` would build a dense [B, 1, T, S] mask
    there (4 GiB for 4096 new tokens over 1M), as SDPA's own `is_causal` aligns the tokens with the cache's start.
    None in every other case. The padding check reads the mask on the host, as transformers'
    `_ignore_causal_mask_sdpa` does for a first forward, so it is skipped while a graph is traced."""
    if config._attn_implementation != "sdpa" or new_tokens < 2 or not isinstance(cache, DynamicCache):
        return None
    if is_tracing(attention_mask):  # reading the mask would break the graph
        return None
    if attention_mask is not None and (attention_mask.ndim != 2 or not attention_mask.all()):  # padded, or 4-D
        return None
    cached = cache.get_seq_length(config.layer_types.index("full_attention"))
    return LowerRightCausalBias(new_tokens, cached + new_tokens) if cached > 0 else None


def layer_type_masks(
    config: KdaMoeTextConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor,
) -> dict[str, torch.Tensor | None]:
    """The mask each layer type reads, from a 2-D padding mask (or None): KDA layers the padding of the new tokens
    (None for a one-token step), MLA layers transformers' causal mask over the cache (built directly for a static
    cache under SDPA or eager attention; a `LowerRightCausalBias` for an unpadded prefill chunk under SDPA)."""
    masks = {"linear_attention": create_recurrent_attention_mask(config, inputs_embeds, attention_mask, cache)}
    if "full_attention" not in config.layer_types:
        return masks
    implementation = config._attn_implementation
    if isinstance(cache, KdaMoeStaticCache) and attention_mask is not None and implementation in STATIC_MASKS:
        masks["full_attention"] = static_cache_causal_mask(
            attention_mask, cache, inputs_embeds.shape[1], inputs_embeds.dtype, additive=implementation == "eager"
        )
    elif (bias := lower_right_causal_bias(config, attention_mask, cache, inputs_embeds.shape[1])) is not None:
        masks["full_attention"] = bias
    else:
        masks["full_attention"] = create_causal_mask(
            config, inputs_embeds, attention_mask, cache, position_ids=position_ids
        )
    return masks


def training_forward_builds_no_cache(forward):
    """A `forward(..., cache=None, use_cache=None)` in training mode with gradients on that is given neither
    `use_cache` nor a cache builds none (`config.use_cache` is the default for inference only): a training forward has
    no later step to continue, and a layer recomputed in the backward (`gradient_checkpointing_enable`, or torch's
    `checkpoint_wrapper` applied from outside, as accelerate's FSDP activation checkpointing does) would write its
    cache a second time. Decorates the forward outside `merge_with_config_defaults`, which fills in the config's
    value."""
    names = list(inspect.signature(forward).parameters)[1:]  # without self
    use_cache_index, cache_index = names.index("use_cache"), names.index("cache")

    @wraps(forward)
    def wrapper(self, *args, **kwargs):
        def given(name, index):
            return kwargs.get(name) is not None or (len(args) > index and args[index] is not None)

        asked = given("use_cache", use_cache_index) or given("cache", cache_index) or (
            kwargs.get("past_key_values") is not None
        )
        if not asked and self.training and torch.is_grad_enabled():
            kwargs["use_cache"] = False
        return forward(self, *args, **kwargs)

    return wrapper


def recomputes_layers_from_outside(model: nn.Module) -> bool:
    """Whether torch's `checkpoint_wrapper` wraps a decoder layer of `model` (accelerate's FSDP activation
    checkpointing, `fsdp2_apply_ac`)."""
    return any(hasattr(layer, "_checkpoint_wrapped_module") for layer in model.layers)


class KdaMoeTextModel(KdaMoePreTrainedModel):
    """Embeddings -> decoder layers -> (final AttnRes mix) -> final norm. `last_hidden_state` feeds `lm_head` as is."""

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KdaMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.out_res = KdaMoeAttnRes(config) if config.attn_res_block_size is not None else None
        self.norm = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        uses_rope = not config.mla_use_nope and "full_attention" in config.layer_types
        self.rotary_emb = KdaMoeRotaryEmbedding(config) if uses_rope else None
        self.gradient_checkpointing = False
        # set by `kda_moe.distributed.context_parallel`: each forward then holds one slice of a sequence split across
        # the ranks of its process group
        self.context_parallel = None
        self.post_init()

    @training_forward_builds_no_cache
    @merge_with_config_defaults
    @capture_outputs
    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        check_text_inputs(self.config, input_ids, inputs_embeds, attention_mask, cache)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        sequence_shard = None
        if self.context_parallel is not None:  # this rank's slice of sequences split across ranks
            sequence_shard = self.context_parallel.shard(
                self.config, inputs_embeds, position_ids, attention_mask, cache
            )
            position_ids, use_cache = sequence_shard.position_ids, False
        # A packed batch (one row, position ids restarting at 0 per sequence) resets KDA at every sequence start and
        # restricts MLA to each sequence; it holds several sequences, so it can neither continue nor fill a cache.
        if sequence_shard is None:
            cu_seqlens = packed_sequence_boundaries(position_ids, inputs_embeds.shape[0])
        else:
            cu_seqlens = sequence_shard.cu_seqlens
        if cu_seqlens is not None and cache is not None:
            raise ValueError(
                "position_ids restart at 0 inside the row (a packed batch of several sequences), but a cache was "
                "passed: packed sequences cannot use a cache. Run each sequence separately, or pass position_ids "
                "that continue from the cache."
            )
        if (self.gradient_checkpointing and self.training) or cu_seqlens is not None:
            use_cache = False  # a recomputed layer would write its cache twice; a packed row has no single future
        if use_cache and self.training and torch.is_grad_enabled() and recomputes_layers_from_outside(self):
            raise ValueError(
                "use_cache=True (or a cache) was passed to a training forward whose decoder layers are wrapped by "
                "torch's checkpoint_wrapper (activation checkpointing, e.g. accelerate's "
                "fsdp_activation_checkpointing): the backward recomputes each layer, which would write its cache a "
                "second time. Leave use_cache unset or pass use_cache=False for training, or run the forward under "
                "torch.no_grad() / in eval mode."
            )
        if not use_cache:
            cache = None
        elif cache is None:
            cache = KdaMoeCache(self.config)

        has_mla = "full_attention" in self.config.layer_types  # position ids are read by MLA layers only
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None and has_mla else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if sequence_shard is not None:  # no masks: unpadded slices; MLA masks block by block (`SequenceShard.attention`)
            mask_mapping = dict.fromkeys(self.config.layer_types)
        elif not isinstance(mask_mapping := attention_mask, dict):
            mask_mapping = layer_type_masks(self.config, inputs_embeds, attention_mask, cache, position_ids)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if self.rotary_emb is not None else None

        # with Block AttnRes the embedding is the first stored block ([1, B, T, d], a view of it)
        hidden_states, blocks = inputs_embeds, None if self.out_res is None else inputs_embeds[None]
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, started = decoder_layer(
                hidden_states,
                blocks,
                attention_mask=mask_mapping[decoder_layer.layer_type],
                position_embeddings=position_embeddings,
                cache=cache,
                cu_seqlens=cu_seqlens,
                sequence_shard=sequence_shard,
                position_ids=position_ids,
                **kwargs,
            )
            blocks = blocks if started is None else started
        if self.out_res is not None:
            hidden_states = self.out_res(hidden_states, blocks)
        hidden_states = self.norm(hidden_states)
        return model_output(MoeModelOutputWithPast, last_hidden_state=hidden_states, cache=cache)


def causal_lm_head(
    model: PreTrainedModel, hidden_states: torch.Tensor, labels: torch.Tensor | None, logits_to_keep, loss_kwargs: dict
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) of a causal LM's `lm_head` on the last hidden states [B, T, d], the loss when labels are given.

    A training forward with labels (training mode, gradients on, every position kept) whose loss is transformers'
    causal LM loss on a plain `lm_head` computes the loss with `linear_cross_entropy`, chunk by chunk, and returns no
    logits: the [B, T, vocab] logits and their fp32 copy are never built. `config.fused_linear_cross_entropy=False`
    keeps the logits; an adapter, hook or sharding plan on `lm_head` (PEFT, tensor parallelism, offloading) or a
    custom `loss_function` takes the logits path too."""
    config = model.config.get_text_config()
    if (
        labels is not None
        and config.fused_linear_cross_entropy
        and model.training
        and torch.is_grad_enabled()
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and is_plain_linear(model.lm_head)
        and model.loss_function is LOSS_MAPPING["ForCausalLM"]
    ):
        loss = linear_cross_entropy(
            hidden_states,
            model.lm_head.weight,
            None if loss_kwargs.get("shift_labels") is not None else labels,
            shift_labels=loss_kwargs.get("shift_labels"),
            ignore_index=loss_kwargs.get("ignore_index", -100),
            num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
        )
        return None, loss
    logits = model.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
    loss = None
    if labels is not None:
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
    return logits, loss


class KdaMoeForCausalLM(KdaMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KdaMoeTextConfig):
        super().__init__(config)
        self.model = KdaMoeTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def create_masks_for_generate(
        self, config: PreTrainedConfig, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs
    ) -> dict[str, torch.Tensor | None]:
        """The per-layer-type masks of a generation step on a compileable cache (transformers' hook, called outside
        the compiled step with the cache under this version's `CACHE_NAME`): `layer_type_masks`."""
        return layer_type_masks(
            config.get_text_config(), inputs_embeds, attention_mask, kwargs[CACHE_NAME], kwargs.get("position_ids")
        )

    # generate() checks its kwargs against this method's signature: keep transformers' (only `__wrapped__` is set)
    @wraps(GenerationMixin.prepare_inputs_for_generation, assigned=())
    def prepare_inputs_for_generation(self, *args, **kwargs):
        """transformers' inputs of a generation step. With a static cache the 2-D padding mask always becomes the
        per-layer-type masks here, outside the compiled step: transformers leaves it 2-D for a model of KDA layers
        only, and a mask that grows by a column every step would recompile the step every time."""
        model_inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        mask, cache = model_inputs.get("attention_mask"), model_inputs.get(CACHE_NAME)
        if isinstance(cache, KdaMoeStaticCache) and isinstance(mask, torch.Tensor) and mask.ndim == 2:
            tokens = model_inputs.get("input_ids")
            tokens = model_inputs["inputs_embeds"] if tokens is None else tokens
            shape_only = torch.empty(*tokens.shape[:2], 0, dtype=self.dtype, device=tokens.device)  # [B, T, 0]
            model_inputs["attention_mask"] = self.create_masks_for_generate(
                self.config, shape_only, mask, **{CACHE_NAME: cache}, position_ids=model_inputs.get("position_ids")
            )
        return model_inputs

    def _sample(
        self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None,
        **model_kwargs,
    ):  # fmt: skip
        """transformers' decoding loop, except for greedy decoding on a static cache that generate() compiles: that
        runs in blocks of `generation_config.decode_steps_per_graph` steps (unset: 16 on a GPU, transformers' loop
        elsewhere; None: transformers' loop), each block one CUDA-graph replay on a GPU (`graphed_decoding.py`): the
        same tokens, without the host work transformers' loop does around every step."""
        steps_per_graph = decode_steps_per_graph(generation_config, self.device)
        implementation = self.config._attn_implementation
        has_mla = "full_attention" in self.config.layer_types
        cache = model_kwargs.get(CACHE_NAME)
        graphed = (
            steps_per_graph is not None
            and not generation_config.do_sample
            and not generation_config.return_dict_in_generate
            and not generation_config.is_assistant
            and streamer is None
            and not synced_gpus
            and len(logits_processor) == 0
            and all(isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)) for criterion in stopping_criteria)
            and stopping_criteria.max_length is not None
            and model_kwargs.get("inputs_embeds") is None
            and isinstance(cache, KdaMoeStaticCache)
            and not getattr(cache, "_is_user_defined", False)
            and (not has_mla or implementation in STATIC_MASKS)
            and self.on_one_device()
            and self._valid_auto_compile_criteria(model_kwargs, generation_config)
        )
        if not graphed:
            return super()._sample(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
                streamer=streamer, **model_kwargs,
            )  # fmt: skip
        forward = uncaptured_compile_call(self, generation_config.compile_config or self._default_compile_config())
        mla_mask = None if not has_mla else "additive" if implementation == "eager" else "bool"
        return greedy_decoding(
            self, input_ids, stopping_criteria, generation_config, model_kwargs, mla_mask, forward, steps_per_graph,
            capture=self.device.type == "cuda",
        )  # fmt: skip

    @can_return_tuple
    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits, loss = causal_lm_head(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs)
        return model_output(
            MoeCausalLMOutputWithPast,
            loss=loss,
            logits=logits,
            cache=output_cache(outputs),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


__all__ = ["KdaMoeCache", "KdaMoeStaticCache", "KdaMoePreTrainedModel", "KdaMoeTextModel", "KdaMoeForCausalLM"]
