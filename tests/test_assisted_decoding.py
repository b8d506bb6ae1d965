"""Assisted and prompt-lookup decoding: `KdaMoeCache.crop` rolls KDA states back, so the tokens are greedy's."""

import copy

import pytest
import torch
from conftest import tiny_model
from test_decoding import randomize_balancing_and_depth_mixing
from transformers import DynamicCache

from kda_moe import KdaMoeCache
from kda_moe.compat import CACHE_NAME, output_cache
from kda_moe.modeling.modeling_kda_moe import KdaMoeLinearAttentionCacheLayer

LAYOUTS = {"hybrid": {}, "pure_kda": {"layer_types": ["linear_attention"] * 5}}
NEW_TOKENS = 16
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


class CropRecordingCache(KdaMoeCache):
    """A `KdaMoeCache` that notes how many tokens each `crop` removes."""

    def __init__(self, config):
        super().__init__(config)
        self.removed = []

    def crop(self, tokens_to_remove: int) -> None:
        self.removed.append(-tokens_to_remove)
        super().crop(tokens_to_remove)


def generate_with_rounds(model, input_ids, **kwargs):
    """generate() on a `CropRecordingCache`: (sequences, the model's forward calls, tokens removed per crop)."""
    cache = CropRecordingCache(model.config)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(None))
    try:
        with torch.no_grad():
            sequences = model.generate(input_ids, **{CACHE_NAME: cache}, **GREEDY, **kwargs)
    finally:
        hook.remove()
    return sequences, len(forwards), cache.removed


def greedy(model, input_ids):
    with torch.no_grad():
        return model.generate(input_ids, **GREEDY)


def perturbed_draft(model, noise=0.1, seed=1):
    """A draft model that agrees with `model` on most tokens, not all: its weights with noise added."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0  # always draft 4: a random model is never confident
    return draft


@pytest.mark.parametrize("layout", LAYOUTS)
def test_assisted_decoding_matches_greedy(layout):
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, **LAYOUTS[layout]))
    input_ids = torch.randint(1, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    assisted, rounds, removed = generate_with_rounds(model, input_ids, assistant_model=perturbed_draft(model))
    assert torch.equal(assisted, greedy(model, input_ids))
    assert rounds < NEW_TOKENS  # some rounds accepted drafted tokens
    assert any(removed)  # and some rolled rejected ones back


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompt_lookup_decoding_matches_greedy(layout):
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, **LAYOUTS[layout]))
    start = torch.tensor([[5, 6, 7, 8, 9]])
    # the model's own continuation, then its start again: the lookup drafts that continuation once the text repeats
    input_ids = torch.cat([greedy(model, start)[:, :13], start], dim=1)
    looked_up, rounds, removed = generate_with_rounds(model, input_ids, prompt_lookup_num_tokens=3)
    assert torch.equal(looked_up, greedy(model, input_ids))
    assert rounds < NEW_TOKENS
    assert any(removed)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_crop_restores_the_states_after_the_accepted_tokens(layout):
    """A window of 5 tokens run on a recording cache and cropped by 3 leaves the cache as a forward over the first 2
    would have left it: the same KDA states and MLA latents, the same logits for the next token (up to the rounding
    of the token-by-token and chunked forms)."""
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, **LAYOUTS[layout]))
    tokens = torch.randint(1, model.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(2))
    prompt, window, following = tokens[:, :7], tokens[:, 7:12], tokens[:, 12:]
    rolled_back, reference = KdaMoeCache(model.config), KdaMoeCache(model.config)
    with torch.no_grad():
        model(prompt, **{CACHE_NAME: rolled_back})
        rolled_back.activate_past_recording(recurrent_states_to_keep=4)
        model(window, **{CACHE_NAME: rolled_back})
        rolled_back.crop(-3)
        model(torch.cat([prompt, window[:, :2]], dim=1), **{CACHE_NAME: reference})
        assert rolled_back.get_seq_length() == reference.get_seq_length() == 9
        for ours, theirs in zip(rolled_back.layers, reference.layers):
            if isinstance(ours, KdaMoeLinearAttentionCacheLayer):
                states, expected_states = (ours.conv_states[0], ours.recurrent_states[0]), (theirs.conv_states[0], theirs.recurrent_states[0])
            else:
                states, expected_states = (ours.keys, ours.values), (theirs.keys, theirs.values)
            torch.testing.assert_close(states, expected_states, rtol=0, atol=1e-5)
        logits = model(following, **{CACHE_NAME: rolled_back}).logits
        expected = model(following, **{CACHE_NAME: reference}).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_assisted_decoding_refuses_a_cache_that_cannot_roll_back():
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 6))
    with pytest.raises(ValueError, match="needs a KdaMoeCache"):
        model.generate(input_ids, prompt_lookup_num_tokens=3, **{CACHE_NAME: DynamicCache(config=model.config)}, **GREEDY)


def test_generate_returns_a_kda_moe_cache_that_counts_tokens_without_mla_layers():
    model = tiny_model(seed=0, layer_types=["linear_attention"] * 5)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        out = model.generate(input_ids, return_dict_in_generate=True, **GREEDY)
    cache = output_cache(out)
    assert isinstance(cache, KdaMoeCache)
    assert cache.get_seq_length() == 6 + NEW_TOKENS - 1  # the last token was sampled, never fed back
