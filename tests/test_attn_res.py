"""Block Attention Residuals against a re-implementation of SPEC.md's pseudocode (not the model's own code)."""

import torch
from conftest import tiny_model


def spec_mix(partial, blocks, proj, norm):
    """SPEC: V = stack(blocks + [partial]); K = RMSNorm_noweight(V); w = norm.weight * proj.weight; softmax(K w) @ V."""
    V = torch.stack(blocks + [partial]).float()
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    w = norm.weight.float() * proj.weight.float().squeeze(0)
    return (torch.softmax(K @ w, dim=0)[..., None] * V).sum(0).to(partial.dtype)


def spec_forward(model, input_ids, mix=spec_mix):
    """The SPEC pseudocode, step by step, calling the model's sublayers (mixers, MLPs, norms) as black boxes."""
    base, block_size = model.model, model.config.attn_res_block_size
    embedding = base.embed_tokens(input_ids)
    partial, blocks = embedding, []
    for index, layer in enumerate(base.layers):
        h = embedding if index == 0 else mix(partial, blocks, layer.attn_res.proj, layer.attn_res.norm)
        if index % block_size == 0:
            blocks.append(partial)
            partial = None
        a = layer.self_attn(layer.input_layernorm(h), attention_mask=None)
        a = a[0] if isinstance(a, tuple) else a
        partial = a if partial is None else partial + a
        h = mix(partial, blocks, layer.mlp_res.proj, layer.mlp_res.norm)
        partial = partial + layer.mlp(layer.post_attention_layernorm(h))
    h = mix(partial, blocks, base.out_res.proj, base.out_res.norm)
    return base.norm(h)


def test_attn_res_matches_spec_pseudocode_on_five_layers_block_two():
    model = tiny_model(seed=4, num_hidden_layers=5, attn_res_block_size=2)
    model.config._attn_implementation = "sdpa"  # attention_mask=None -> causal in the reference calls
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "res." in name:  # pseudo-queries and their norm weights: away from the uniform init
                param.copy_(torch.randn_like(param))
    input_ids = torch.randint(1, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = spec_forward(model, input_ids)
        actual = model.model(input_ids).last_hidden_state
    assert (actual - expected).abs().max() < 1e-5
    # The head applies lm_head alone on top of the mixed and normed state.
    assert torch.allclose(model(input_ids).logits, model.lm_head(actual), atol=1e-6)


def test_zero_pseudo_queries_mix_as_plain_average():
    model = tiny_model(seed=5, num_hidden_layers=5, attn_res_block_size=2)
    model.config._attn_implementation = "sdpa"
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if n.endswith("res.proj.weight"))

    def average(partial, blocks, proj, norm):
        return torch.stack(blocks + [partial]).mean(0)

    input_ids = torch.randint(1, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        expected = spec_forward(model, input_ids, mix=average)
        actual = model.model(input_ids).last_hidden_state
    assert (actual - expected).abs().max() < 1e-5
    mixer = model.model.layers[3].attn_res
    partial, blocks = torch.randn(2, 3, 32), torch.randn(2, 2, 3, 32)
    assert torch.allclose(mixer(partial, blocks), torch.cat([blocks, partial[None]]).mean(0), atol=1e-6)


def test_plain_residuals_when_attn_res_is_off():
    model = tiny_model(seed=6, attn_res_block_size=None)
    model.config._attn_implementation = "sdpa"
    assert model.model.out_res is None and all(layer.attn_res is None for layer in model.model.layers)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        h = model.model.embed_tokens(input_ids)
        for layer in model.model.layers:
            a = layer.self_attn(layer.input_layernorm(h), attention_mask=None)
            h = h + (a[0] if isinstance(a, tuple) else a)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        expected = model.model.norm(h)
        actual = model.model(input_ids).last_hidden_state
    assert (actual - expected).abs().max() < 1e-5
