"""Output conventions of the models: `output_attentions` per layer, and the legacy `past_key_values=` argument."""

import warnings

import pytest
import torch
from conftest import tiny_model
from multimodal_testing import tiny_multimodal_model
from transformers import LlamaConfig, LlamaForCausalLM

from kda_moe import KdaMoeCache
from kda_moe.compat import CACHE_NAME


def assert_one_attention_entry_per_layer(attentions, layer_types, batch_size, seq_len, num_heads):
    assert len(attentions) == len(layer_types)
    for layer, (kind, weights) in enumerate(zip(layer_types, attentions)):
        if kind == "linear_attention":
            assert weights is None, layer
        else:
            assert weights.shape == (batch_size, num_heads, seq_len, seq_len), layer
            torch.testing.assert_close(weights.sum(-1), torch.ones(batch_size, num_heads, seq_len))


@pytest.mark.parametrize("return_dict", [True, False])
def test_output_attentions_has_one_entry_per_layer_none_for_kda(return_dict):
    model = tiny_model(seed=0)
    model.set_attn_implementation("eager")
    config = model.config
    assert "linear_attention" in config.layer_types and "full_attention" in config.layer_types
    input_ids = torch.randint(1, config.vocab_size, (2, 6))
    with torch.no_grad():
        out = model(input_ids, output_attentions=True, return_dict=return_dict)
        base = model.model(input_ids, output_attentions=True, return_dict=return_dict)
    for attentions in (out.attentions, base.attentions) if return_dict else (out[-1], base[-1]):
        assert_one_attention_entry_per_layer(attentions, config.layer_types, 2, 6, config.num_attention_heads)


def test_output_attentions_of_the_multimodal_model_has_one_entry_per_text_layer():
    model = tiny_multimodal_model(seed=0)
    model.set_attn_implementation("eager")
    text_config = model.config.text_config
    input_ids = torch.randint(20, text_config.vocab_size, (1, 5))
    with torch.no_grad():
        attentions = model(input_ids, output_attentions=True).attentions
    assert_one_attention_entry_per_layer(attentions, text_config.layer_types, 1, 5, text_config.num_attention_heads)


def legacy_cache_warnings(model, cache):
    """The warnings of one forward that passes the cache as `past_key_values=`, messages without the class name."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.tensor([[3, 4, 5]]), past_key_values=cache, use_cache=True)
    return [(w.category, str(w.message).replace(type(model).__name__, "<model>")) for w in caught]


def test_past_key_values_argument_warns_exactly_like_transformers_models():
    """transformers 5.24+ renamed the cache argument to `cache` and its own models warn (FutureWarning) when given
    `past_key_values=`; 5.17's models take `past_key_values` and say nothing. Ours follow whichever is installed, and
    still use the cache passed under the old name."""
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).eval()
    expected = legacy_cache_warnings(llama, None)
    model = tiny_model(seed=0)
    cache = KdaMoeCache(model.config)
    assert legacy_cache_warnings(model, cache) == expected
    assert cache.get_seq_length() == 3
    if CACHE_NAME == "cache":
        assert expected and all(category is FutureWarning and "past_key_values" in text for category, text in expected)
    else:
        assert expected == []


def test_generate_and_nested_models_pass_the_cache_without_warnings():
    text_model, multimodal = tiny_model(seed=0), tiny_multimodal_model(seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values")
        with torch.no_grad():
            text_model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
            multimodal.generate(torch.tensor([[30, 40, 50]]), max_new_tokens=3, do_sample=False)
            multimodal(torch.tensor([[30, 40]]), **{CACHE_NAME: KdaMoeCache(multimodal.config)}, use_cache=True)
