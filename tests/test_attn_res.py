"""Block Attention Residuals against a step-by-step re-implementation of their pseudocode (not the model's own code),
and their fp32 mixing under autocast."""

import torch
from conftest import tiny_model


def reference_mix(partial, blocks, proj, norm):
    """V = stack(blocks + [partial]); K = RMSNorm_noweight(V); w = norm.weight * proj.weight; softmax(K w) @ V."""
    V = torch.stack(blocks + [partial]).float()
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    w = norm.weight.float() * proj.weight.float().squeeze(0)
    return (torch.softmax(K @ w, dim=0)[..., None] * V).sum(0).to(partial.dtype)


def reference_forward(model, input_ids, mix=reference_mix):
    """The Block AttnRes pseudocode, step by step, calling the model's sublayers (mixers, MLPs, norms) as black boxes:

    layer l: h = mix(partial, blocks) (layer 0: the embedding); a new block starts every `block_size` layers;
    partial += mixer(norm(h)); h = mix(partial, blocks); partial += mlp(norm(h)). End: mix, final norm.
    """
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


def test_attn_res_matches_the_pseudocode_on_five_layers_block_two():
    model = tiny_model(seed=4, num_hidden_layers=5, attn_res_block_size=2)
    model.config._attn_implementation = "sdpa"  # attention_mask=None -> causal in the reference calls
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "res." in name:  # pseudo-queries and their norm weights: away from the uniform init
                param.copy_(torch.randn_like(param))
    input_ids = torch.randint(1, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = reference_forward(model, input_ids)
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
        expected = reference_forward(model, input_ids, mix=average)
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


def test_attn_res_mixes_in_fp32_under_autocast():
    model = tiny_model(seed=4, attn_res_block_size=2)
    mixer = model.model.layers[3].attn_res
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mixer.proj.weight.copy_(torch.randn(mixer.proj.weight.shape, generator=generator))
    partial, blocks = torch.randn(4, 7, 32, generator=generator), torch.randn(2, 4, 7, 32, generator=generator)
    with torch.no_grad():
        expected = mixer(partial, blocks)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = mixer(partial, blocks)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, expected)


def test_permuted_batch_gives_each_row_exactly_its_logits_under_bf16_autocast():
    """RL trainers re-order rows between the rollout and the training forward: under bf16 autocast each row must get
    bit for bit the logits it gets in its original position, or the on-policy importance ratio is not 1."""
    model = tiny_model(seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("res.proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
    input_ids = torch.randint(1, model.config.vocab_size, (8, 33), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::3, :5] = 0  # left padding in some rows
    permutation = torch.randperm(8, generator=generator)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids, attention_mask=attention_mask).logits
        permuted = model(input_ids[permutation], attention_mask=attention_mask[permutation]).logits
    assert logits.dtype == torch.bfloat16
    assert torch.equal(permuted, logits[permutation])
