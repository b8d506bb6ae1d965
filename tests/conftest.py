"""Shared helpers: tiny configs that keep the CPU suite fast while switching every feature on."""

import os

import torch

if not torch.cuda.is_available():
    # Without CUDA the Triton kernels can only run in Triton's interpreter, which is chosen when a kernel is
    # decorated, i.e. when `kda_moe` is imported: set it before any test imports the package.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def tiny_config(**overrides):
    """A 5-layer model with every K3 feature on: bounded KDA, gated MLA, AttnRes (block 2), LatentMoE with norm,
    SiTU-GLU, Quantile Balancing. Layer types: KDA, KDA, KDA, MLA, MLA; the first MLP is dense."""
    from kda_moe import KdaMoeTextConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=5,
        linear_num_heads=2,
        linear_head_dim=8,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=16,
        intermediate_size=48,
        routed_expert_hidden_size=16,
        kernel_backend="torch",
        pad_token_id=0,
    )
    values.update(overrides)
    return KdaMoeTextConfig(**values)


def tiny_model(seed: int = 0, **overrides):
    from kda_moe import KdaMoeForCausalLM

    torch.manual_seed(seed)
    model = KdaMoeForCausalLM(tiny_config(**overrides)).eval()
    model.generation_config.eos_token_id = None  # random weights: let every generation run its full length
    return model


@pytest.fixture
def make_model():
    return tiny_model
