"""Bad input to the model fails loudly with a message that names the problem and the fix."""

import pytest
import torch
from conftest import tiny_model

from kda_moe.compat import output_cache
from kda_moe.kernels import backend


def test_triton_backend_request_fails_loudly_instead_of_falling_back(monkeypatch):
    model = tiny_model(seed=0, kernel_backend="triton")
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    if backend.TRITON_AVAILABLE:  # CPU tensors still need the interpreter
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="CPU|cpu|device"):
            model(input_ids)
    else:
        with pytest.raises(ImportError, match="kernel_backend=.torch."):
            model(input_ids)


def test_environment_variable_overrides_the_config_backend(monkeypatch):
    model = tiny_model(seed=0, kernel_backend="triton")
    monkeypatch.setenv("KDA_MOE_BACKEND", "torch")
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        assert model(input_ids).logits.shape == (1, 5, model.config.vocab_size)


def test_input_ids_and_inputs_embeds_together_are_rejected():
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=input_ids, inputs_embeds=model.model.embed_tokens(input_ids))


# ---------------------------------------------------------------- token ids and embeddings


@pytest.mark.parametrize("bad_id, low, high", [(97, 1, 97), (-1, -1, 3), (10**6, 1, 10**6)])
def test_out_of_vocabulary_ids_raise_naming_vocab_size_and_the_id_range(bad_id, low, high):
    model = tiny_model(seed=0)
    input_ids = torch.tensor([[1, bad_id, 3]])
    with pytest.raises(ValueError, match=rf"ids in \[{low}, {high}\].*vocab_size=97.*resize_token_embeddings"):
        model(input_ids)


@pytest.mark.parametrize(
    "input_ids, message",
    [
        (torch.ones(1, 0, dtype=torch.long), r"no tokens \(shape \(1, 0\)\); pass one or more per sequence"),
        (torch.ones(0, 5, dtype=torch.long), r"empty batch \(shape \(0, 5\)\); pass at least one sequence"),
        (torch.ones(5, dtype=torch.long), r"must be \[batch, seq_len\], got shape \(5,\); .* pass `input_ids\[None\]`"),
        (torch.ones(1, 1, 5, dtype=torch.long), r"must be \[batch, seq_len\], got shape \(1, 1, 5\)"),
        (torch.ones(1, 5), r"integer token ids, got dtype torch.float32"),
    ],
    ids=["empty_sequence", "empty_batch", "one_dimensional", "three_dimensional", "float_ids"],
)
def test_malformed_input_ids_raise_with_the_fix(input_ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(seed=0)(input_ids)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((5, 32), r"\[batch, seq_len, hidden_size\], got shape \(5, 32\); .* pass `inputs_embeds\[None\]`"),
        ((1, 5, 31), r"hidden_size=32\], got shape \(1, 5, 31\); build them with `model.get_input_embeddings"),
        ((1, 0, 32), r"no tokens"),
        ((0, 5, 32), r"empty batch"),
    ],
)
def test_malformed_inputs_embeds_raise_with_the_fix(shape, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(seed=0)(inputs_embeds=torch.randn(shape))


def test_input_checks_trace_into_one_compiled_graph():
    """The checks that read tensor values on the host (id range, cached token count) step aside while tracing, so
    torch.compile captures the input checks without a graph break (fullgraph=True would raise on one)."""
    from kda_moe.modeling.modeling_kda_moe import check_text_inputs

    config = tiny_model(seed=0).config

    @torch.compile(backend="eager", fullgraph=True)
    def checked_embedding_input(input_ids, attention_mask):
        check_text_inputs(config, input_ids, None, attention_mask, cache=None)
        return input_ids + 1

    input_ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(checked_embedding_input(input_ids, torch.ones(1, 3)), input_ids + 1)


# ---------------------------------------------------------------- attention mask


@pytest.mark.parametrize(
    "mask_shape",
    [(2, 5), (1, 7), (1, 3), (5,), (1, 5, 5)],
    ids=["more_rows_than_the_batch", "longer", "shorter", "one_dimensional", "three_dimensional"],
)
def test_attention_mask_of_the_wrong_shape_raises_naming_the_expected_shape(mask_shape):
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match=r"\[batch, cached \+ new tokens\] = \[1, 0 \+ 5\]"):
        model(input_ids, attention_mask=torch.ones(mask_shape, dtype=torch.long))


def test_attention_mask_while_decoding_must_cover_the_cached_tokens():
    """generate() passes the mask of every cached and new token; a mask of the new tokens only would be read as
    the first tokens by MLA layers and as the last ones by KDA layers, so it is refused."""
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        cache = output_cache(model(input_ids[:, :5], attention_mask=mask[:, :5], use_cache=True))
        with pytest.raises(ValueError, match=r"has shape \(2, 1\), but this forward needs .* = \[2, 5 \+ 1\]"):
            model(input_ids[:, 5:], attention_mask=mask[:, 5:], cache=cache, use_cache=True)
        stepped = model(input_ids[:, 5:], attention_mask=mask, cache=cache, use_cache=True).logits
        full = model(input_ids, attention_mask=mask).logits
    assert (stepped[:, -1] - full[:, -1]).abs().max() < 1e-4


def test_pure_kda_decoding_accepts_the_full_length_mask():
    """A pure-KDA model has no attention layer; its cache still lets the full-length mask through on every
    transformers version (5.17 cannot count the cached tokens of such a cache, 5.25 can)."""
    model = tiny_model(seed=0, layer_types=["linear_attention"] * 5)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        cache = output_cache(model(input_ids[:, :5], attention_mask=torch.ones(1, 5), use_cache=True))
        stepped = model(input_ids[:, 5:], attention_mask=torch.ones(1, 6), cache=cache, use_cache=True).logits
        full = model(input_ids).logits
    assert (stepped[:, -1] - full[:, -1]).abs().max() < 1e-4


def test_four_dimensional_masks_and_mask_dicts_keep_working():
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None]  # [1, 1, 5, 5]
    with torch.no_grad():
        plain = model(input_ids).logits
        four_d = model(input_ids, attention_mask=causal).logits
        mapping = model(input_ids, attention_mask={"linear_attention": None, "full_attention": causal}).logits
    assert (four_d - plain).abs().max() < 1e-5 and (mapping - plain).abs().max() < 1e-5
