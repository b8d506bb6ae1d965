"""save_pretrained / from_pretrained round trips, output recording (remote-code loading: test_remote_code.py; the K3
shape on the meta device: test_big_model_loading.py)."""

import pytest
import torch
from conftest import tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from kda_moe import KdaMoeForCausalLM, KdaMoeTextModel


def trained_once(model):
    """One training step so that every weight and every router bias differs from its init."""
    model.train()
    input_ids = torch.randint(1, model.config.vocab_size, (2, 10))
    model(input_ids, labels=input_ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.1)
    return model.eval()


def test_save_then_auto_from_pretrained_is_bit_exact(tmp_path):
    model = trained_once(tiny_model(seed=0))
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is KdaMoeForCausalLM
    original, loaded = model.state_dict(), reloaded.state_dict()
    assert original.keys() == loaded.keys()
    for name in original:
        assert original[name].dtype == loaded[name].dtype and torch.equal(original[name], loaded[name]), name
    input_ids = torch.randint(1, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        # Weights are bit-identical (above); loaded tensors live in differently aligned memory, which can steer CPU
        # BLAS onto another SIMD path, so logits may differ in the last fp32 bit.
        assert (model(input_ids).logits - reloaded(input_ids).logits).abs().max() < 1e-6
    assert type(AutoModel.from_pretrained(tmp_path)) is KdaMoeTextModel
    volatile = ("_name_or_path", "transformers_version")
    loaded_config = {k: v for k, v in AutoConfig.from_pretrained(tmp_path).to_dict().items() if k not in volatile}
    assert loaded_config == {k: v for k, v in model.config.to_dict().items() if k not in volatile}


def test_outputs_record_hidden_states_attentions_and_router_logits():
    model = tiny_model(seed=0)
    model.config._attn_implementation = "eager"
    input_ids = torch.randint(1, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True, output_attentions=True, output_router_logits=True)
    config = model.config
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(input_ids))
    assert len(out.attentions) == config.num_hidden_layers  # one entry per layer, None for KDA layers
    mla = config.layer_types.index("full_attention")
    assert out.attentions[mla].shape == (2, config.num_attention_heads, 6, 6)
    assert torch.allclose(out.attentions[mla].sum(-1), torch.ones(2, config.num_attention_heads, 6))
    assert len(out.router_logits) == config.mlp_layer_types.count("sparse")
    assert out.router_logits[0].shape == (2 * 6, config.num_experts)


def test_logits_to_keep_slices_the_last_positions():
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        full = model(input_ids).logits
        last = model(input_ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, model.config.vocab_size) and torch.allclose(last, full[:, -1:], atol=1e-6)


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_experts_implementations_match_eager(implementation):
    eager = tiny_model(seed=0)
    other = tiny_model(seed=0, experts_implementation=implementation)
    assert other.config._experts_implementation == implementation
    input_ids = torch.randint(1, eager.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert (eager(input_ids).logits - other(input_ids).logits).abs().max() < 1e-5


def test_sdpa_matches_eager_attention():
    eager = tiny_model(seed=0, mla_use_nope=False)
    eager.config._attn_implementation = "eager"
    sdpa = tiny_model(seed=0, mla_use_nope=False)
    sdpa.config._attn_implementation = "sdpa"
    input_ids = torch.randint(1, eager.config.vocab_size, (2, 8))
    with torch.no_grad():
        assert (eager(input_ids).logits - sdpa(input_ids).logits).abs().max() < 1e-5


def test_tied_embeddings_share_one_tensor(tmp_path):
    model = tiny_model(seed=0, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    reloaded = KdaMoeForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
