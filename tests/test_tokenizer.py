"""The tokenizer shipped in the package: Unicode round trips, atomic special tokens, deterministic training."""

import filecmp

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kda_moe.processing import TOKENIZER_DIR
from kda_moe.processing.train_tokenizer import (
    MEDIA_TOKENS,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    END_OF_TURN,
    save,
    train,
)
from kda_moe.configuration.configuration_kda_moe_vision import BUNDLED_IMAGE_TOKEN_ID
from kda_moe import KdaMoeConfig, KdaMoeTextConfig


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_unicode_round_trips(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_TOKENS[4:])), max_size=8))
def test_special_tokens_stay_atomic_inside_any_text(tokenizer, pieces):
    text = "".join(pieces)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    tokens = tokenizer.convert_ids_to_tokens(ids)
    for special in SPECIAL_TOKENS[4:]:
        assert tokens.count(special) == text.count(special)


@pytest.mark.parametrize("token", MEDIA_TOKENS + ROLE_TOKENS + [END_OF_TURN] + TOOL_TOKENS)
def test_each_special_token_is_one_id(tokenizer, token):
    ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[1] == token
    assert ids[1] == SPECIAL_TOKENS.index(token)


def test_ids_match_the_default_configs(tokenizer):
    assert len(tokenizer) == KdaMoeTextConfig().vocab_size
    text = KdaMoeTextConfig()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        text.pad_token_id, text.bos_token_id, text.eos_token_id,
    )  # fmt: skip
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") == BUNDLED_IMAGE_TOKEN_ID == KdaMoeConfig().image_token_id
    assert tokenizer.image_token == "<|media_pad|>"


def test_skip_special_tokens_drops_chat_markup(tokenizer):
    ids = tokenizer("<|im_user|>user<|im_middle|>hello<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "userhello"


def test_training_script_reproduces_the_shipped_tokenizer(tmp_path):
    save(train(), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(tmp_path / name, TOKENIZER_DIR / name, shallow=False), name
