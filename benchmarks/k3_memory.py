"""Memory per GPU of training Kimi K3 at each stage of the 8K -> 64K -> 256K -> 1M curriculum, by calculation.

    python benchmarks/k3_memory.py [gpus=1024] [ep=128]      (kda_moe importable; no GPU needed)

Every term is computed from `KdaMoeTextConfig.kimi_k3()`; the table gives GiB per GPU. Assumptions:

- Mesh: `gpus` ranks; experts split over an expert-parallel group of `ep` ranks (num_experts / ep each); context
  parallelism over `cp` ranks per stage (one sequence per cp group: cp = 1, 8, 32, 128 for 8K, 64K, 256K, 1M, so
  8192 tokens per GPU at every stage), data parallelism over the other gpus / cp. FSDP2 shards every dense parameter over all gpus (dp x cp flattened, as the
  cp ranks hold the same parameters) and every expert's weights over the gpus / ep ranks that hold the same experts.
- Weights bf16 (2 bytes), gradients bf16 (2), AdamW fp32 master weights and two moments (12): 16 bytes per
  parameter, sharded, so `states` = 16 x parameters / gpus. FSDP's working set (`fsdp_buffers`): two layers unsharded
  at once (the running one and the prefetched one), their bf16 weights and bf16 gradients, the largest layer counted
  (an MoE layer holds its num_experts / ep experts).
- Activation checkpointing per decoder layer (`checkpointed`): every layer's input [t, d] in bf16 is kept (and the
  last layer's output), t = tokens per GPU = sequence / cp, and the AttnRes block states: layer inputs include the blocks stored so far, one tensor
  [j, t, d] per block j >= 2 (shared by its layers; the first block is the embeddings, the last feeds the final mix).
- One layer's activations at a time, recomputed in the backward (`one_layer`, the largest layer type), bf16 unless
  noted: KDA: q, k, v, the gate g (fp32), beta, the conv inputs, the gated output, the chunked kernel's states at every
  chunk (fp32, [K, V + K] per head under context parallelism: the state and the slice transition) and the gathered
  transitions of the cp ranks (fp32); MLA (absorbed form under context parallelism): the queries against the latent
  [t, H, kv_lora + rope], the latents gathered from every rank up to this one's end [sequence, kv_lora + rope] and
  their fp32 gradients, the output [t, H, kv_lora] and the fp32 scores of one attention block per head; MoE: the
  router logits (fp32), the tokens dispatched to the top-k experts at the latent width, their gate / up activations and
  the shared experts' activations. Temporaries of the kernels, the logits of the loss (chunked by the trainer) and the
  allocator's fragmentation are not counted.
"""

import math
import sys
from dataclasses import dataclass

GIB = 2**30
STAGES = {"8K": (8192, 1), "64K": (65536, 8), "256K": (262144, 32), "1M": (1048576, 128)}  # tokens, cp ranks
BF16, FP32 = 2, 4
STATE_BYTES = 2 + 2 + 12  # bf16 weight + bf16 gradient + fp32 AdamW master, exp_avg, exp_avg_sq
KDA_CHUNK = 64  # the chunked kernel's chunk length: one state saved per chunk
ATTENTION_BLOCK = 1024  # `kda_moe.distributed.context_parallel.BLOCK_SIZE`


def kda_parameters(c) -> int:
    width = c.linear_num_heads * c.linear_head_dim
    gate = c.hidden_size * width if c.use_full_rank_gate else (c.hidden_size + width) * c.linear_head_dim
    return (
        3 * c.hidden_size * width  # q, k, v
        + 3 * width * c.linear_conv_kernel_dim  # depthwise short conv
        + (c.hidden_size + width) * c.linear_head_dim  # forget gate f_a, f_b
        + c.linear_num_heads + width  # A_log, dt_bias
        + c.hidden_size * c.linear_num_heads  # beta
        + gate
        + c.linear_head_dim  # output norm
        + width * c.hidden_size  # o_proj
    )


def mla_parameters(c) -> int:
    heads, qk_dim = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        query = c.hidden_size * heads * qk_dim
    else:
        query = c.hidden_size * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk_dim
    return (
        query
        + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # latent + rope key, latent norm
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj
        + (c.hidden_size * heads * c.v_head_dim if c.mla_use_output_gate else 0)
        + heads * c.v_head_dim * c.hidden_size  # o_proj
    )


def moe_parameters(c) -> tuple[int, int]:
    """(routed experts' parameters, the rest of the sparse MLP: router, latent projections and norm, shared experts)."""
    latent = c.routed_expert_hidden_size
    experts = c.num_experts * 3 * c.moe_intermediate_size * (latent or c.hidden_size)
    rest = c.num_experts * c.hidden_size + 3 * c.hidden_size * c.moe_intermediate_size * c.num_shared_experts
    if latent:
        rest += 2 * c.hidden_size * latent + (latent if c.latent_moe_use_norm else 0)
    return experts, rest


@dataclass
class ParameterCounts:
    dense: int  # sharded over every GPU
    experts: int  # split over ep, then sharded over gpus / ep
    largest_layer_dense: int  # the largest decoder layer's dense parameters
    largest_layer_experts: int  # and its routed experts' (all of them)

    @property
    def total(self) -> int:
        return self.dense + self.experts


def parameter_counts(c) -> ParameterCounts:
    d = c.hidden_size
    dense = c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d  # embeddings, lm_head, final norm
    attn_res = c.attn_res_block_size is not None
    dense += 2 * d if attn_res else 0  # the final AttnRes mixture
    experts, largest = 0, (0, 0)
    for index, (layer_type, mlp_type) in enumerate(zip(c.layer_types, c.mlp_layer_types)):
        layer = kda_parameters(c) if layer_type == "linear_attention" else mla_parameters(c)
        layer += 2 * d + (2 * d if attn_res and index > 0 else 0) + (2 * d if attn_res else 0)  # norms, AttnRes
        layer_experts = 0
        if mlp_type == "sparse":
            layer_experts, rest = moe_parameters(c)
            layer += rest
        else:
            layer += 3 * d * c.intermediate_size
        dense, experts = dense + layer, experts + layer_experts
        largest = max(largest, (layer, layer_experts), key=lambda sizes: sizes[0] + sizes[1])
    return ParameterCounts(dense, experts, *largest)


def activation_bytes(c, sequence: int, cp: int) -> dict[str, float]:
    """Activation bytes per GPU for one sequence of `sequence` tokens split over `cp` ranks: the checkpointed layer
    inputs and AttnRes block states, and the largest layer's recomputed activations."""
    t, d = sequence // cp, c.hidden_size
    blocks = math.ceil(c.num_hidden_layers / c.attn_res_block_size) if c.attn_res_block_size else 0
    # the blocks tensors of 2, ..., N summaries (the first one is a view of the embeddings, layer 0's input)
    block_states = blocks * (blocks + 1) // 2 - 1 if blocks else 0
    checkpointed = (c.num_hidden_layers + 1 + block_states) * t * d * BF16  # + the last layer's output

    heads, width = c.linear_num_heads, c.linear_num_heads * c.linear_head_dim
    state_columns = c.linear_head_dim * (2 if cp > 1 else 1)  # [K, V + K] under context parallelism
    kda = (
        t * width * (3 * BF16 + FP32 + 3 * BF16 + 2 * BF16)  # q, k, v; g (fp32); conv inputs; output and its gate
        + t * heads * FP32  # beta
        + math.ceil(t / KDA_CHUNK) * heads * c.linear_head_dim * state_columns * FP32  # chunk states
        + (cp * heads * c.linear_head_dim * state_columns * FP32 if cp > 1 else 0)  # gathered slice transitions
    )
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    mla = (
        t * c.num_attention_heads * latent * BF16  # absorbed queries
        + sequence * latent * (BF16 + 2 * FP32)  # gathered latents (the last rank's: every token) and their gradients
        + t * c.num_attention_heads * c.kv_lora_rank * (BF16 + FP32)  # output, its fp32 accumulator
        + 3 * c.num_attention_heads * min(t, ATTENTION_BLOCK) ** 2 * FP32  # one block's scores, probabilities, grads
    )
    moe = 0
    if "sparse" in c.mlp_layer_types:
        routed_width = c.routed_expert_hidden_size or d
        moe = (
            t * c.num_experts * FP32  # router logits
            + t * c.num_experts_per_tok * (routed_width + 3 * c.moe_intermediate_size) * BF16  # dispatched, gate|up, act
            + t * (2 * routed_width + 3 * c.moe_intermediate_size * c.num_shared_experts) * BF16  # latent, shared
        )
    one_layer = max(kda, mla) + moe + 4 * t * d * BF16  # the mixer, the MLP, the layer's norms and residual sums
    return {"checkpointed": checkpointed, "one_layer": one_layer}


def memory_table(c, gpus: int, ep: int, stages=STAGES) -> list[dict]:
    """One row per stage: the mesh degrees and GiB per GPU of each term."""
    if gpus % ep or c.num_experts % ep:
        raise ValueError(f"ep={ep} must divide gpus={gpus} and num_experts={c.num_experts}")
    counts = parameter_counts(c)
    states = STATE_BYTES * counts.total / gpus
    unsharded_layer = counts.largest_layer_dense + counts.largest_layer_experts / ep
    fsdp_buffers = 2 * unsharded_layer * (BF16 + BF16)
    rows = []
    for name, (sequence, cp) in stages.items():
        if gpus % cp:
            raise ValueError(f"cp={cp} of stage {name} must divide gpus={gpus}")
        activations = activation_bytes(c, sequence, cp)
        row = {"stage": name, "tokens": sequence, "fsdp": gpus, "ep": ep, "cp": cp, "dp": gpus // cp}
        row |= {"tokens_per_gpu": sequence // cp, "states": states, "fsdp_buffers": fsdp_buffers, **activations}
        row["total"] = states + fsdp_buffers + activations["checkpointed"] + activations["one_layer"]
        rows.append(row)
    return rows


BYTE_COLUMNS = ("states", "fsdp_buffers", "checkpointed", "one_layer", "total")


def markdown(rows: list[dict]) -> str:
    """The table in GiB per GPU."""
    columns = ["stage", "tokens", "fsdp", "ep", "cp", "dp", "tokens_per_gpu", *BYTE_COLUMNS]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[k] / GIB:.1f}" if k in BYTE_COLUMNS else str(row[k]) for k in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from kda_moe import KdaMoeTextConfig

    options = dict(arg.split("=", 1) for arg in argv)
    gpus, ep = int(options.get("gpus", 1024)), int(options.get("ep", 128))
    config = KdaMoeTextConfig.kimi_k3()
    counts = parameter_counts(config)
    print(
        f"Kimi K3: {counts.total / 1e12:.2f}T parameters ({counts.experts / 1e12:.2f}T in routed experts); {gpus} GPUs, "
        f"FSDP over all {gpus}, EP {ep} ({config.num_experts // ep} experts per GPU), CP per stage; GiB per GPU\n"
    )
    print(markdown(memory_table(config, gpus, ep)))


if __name__ == "__main__":
    main(sys.argv[1:])
