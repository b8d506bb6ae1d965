"""The tokenizer shipped in the package: Unicode round trips, atomic special tokens, deterministic training."""

import filecmp
import json

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


# ----- Kimi's tiktoken-format tokenizer (`tiktoken.model` + `tokenizer_config.json`), converted to a fast tokenizer

# Tokens merged on top of the 256 bytes, in rank order; each is two earlier tokens joined (as BPE ranks are).
KIMI_MERGES = [
    b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"th", b" th", b" the", b"in", b"ing",
    "你".encode()[:2], "你".encode(), "好".encode()[:2], "好".encode(), "你好".encode(),
]  # fmt: skip
# Special tokens by offset after the BPE ranks, with gaps, in the style of Kimi K2's `added_tokens_decoder`.
KIMI_SPECIAL_TOKENS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip
KIMI_TEXTS = [
    "hello world",
    "the thing in the world, 你好世界!",
    "<|im_user|>user<|im_middle|>hello there<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "ÉCOLE école don't 1234567\n\n  x\ty",
]


def kimi_ranks() -> dict[bytes, int]:
    ranks = {bytes([byte]): byte for byte in range(256)}
    for token in KIMI_MERGES:
        assert any(token[:i] in ranks and token[i:] in ranks for i in range(1, len(token)))
        ranks[token] = len(ranks)
    return ranks


def write_kimi_tokenizer(folder, special_tokens=KIMI_SPECIAL_TOKENS):
    """A tiny tokenizer folder in the layout Kimi publishes: the base64 rank file and a config naming the special
    tokens by id."""
    import base64

    ranks = kimi_ranks()
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    decoder = {
        str(len(ranks) + offset): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True}
        for offset, token in special_tokens.items()
    }  # fmt: skip
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "additional_special_tokens": [KIMI_SPECIAL_TOKENS[offset] for offset in (2, 3, 4, 10, 17)],
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "model_max_length": 1048576,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return ranks


@pytest.fixture
def kimi_folder(tmp_path):
    pytest.importorskip("tiktoken")
    write_kimi_tokenizer(tmp_path)
    return tmp_path


def test_kimi_tiktoken_tokenizer_encodes_as_tiktoken_does(kimi_folder):
    import tiktoken

    from kda_moe.processing import KIMI_PATTERN, kimi_tiktoken_tokenizer

    tokenizer = kimi_tiktoken_tokenizer(kimi_folder)
    ranks = kimi_ranks()
    reference = tiktoken.Encoding(
        "kimi_tiny", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
        special_tokens={token: len(ranks) + offset for offset, token in KIMI_SPECIAL_TOKENS.items()},
    )  # fmt: skip
    for text in KIMI_TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == reference.encode(text, allowed_special="all"), text
        assert tokenizer.decode(ids) == text
    # "你好" is one merged token, "世界" falls back to its six bytes
    assert len(tokenizer.encode("你好世界", add_special_tokens=False)) == 1 + len("世界".encode())


def test_kimi_special_tokens_keep_their_published_ids_and_round_trip(kimi_folder, tmp_path):
    from kda_moe.processing import kimi_tiktoken_tokenizer

    tokenizer = kimi_tiktoken_tokenizer(kimi_folder)
    base = len(kimi_ranks())
    assert len(tokenizer) == base + 256
    for offset, token in KIMI_SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == base + offset, token
    assert tokenizer.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (base, base + 1, base + 255)
    text = KIMI_TEXTS[2]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "userhello thereassistant"

    tokenizer.save_pretrained(tmp_path / "fast")  # an ordinary tokenizer.json: no tiktoken needed to load it
    assert (tmp_path / "fast" / "tokenizer.json").is_file()
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "fast")
    for text in KIMI_TEXTS:
        assert reloaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)


def test_kimi_tokenizer_config_that_does_not_match_the_rank_file_is_refused(tmp_path):
    pytest.importorskip("tiktoken")
    from kda_moe.processing import kimi_tiktoken_tokenizer

    write_kimi_tokenizer(tmp_path, {**KIMI_SPECIAL_TOKENS, -3: "<|misplaced|>"})
    with pytest.raises(ValueError, match="do not belong together"):
        kimi_tiktoken_tokenizer(tmp_path)


# ----- the chat format with tools: rendered by `chat_template.jinja`, assistant turns parsed back by transformers'
# `parse_response` with `KIMI_RESPONSE_TEMPLATE`

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CALLS = [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
    {"id": "functions.get_weather:1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "東京"}}},
]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": TOOL_CALLS},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"celsius": 21}'},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": '{"celsius": 17}'},
    {"role": "assistant", "content": "Paris: 21 °C, Tokyo: 17 °C."},
]


@pytest.fixture(scope="module")
def processor():
    from kda_moe import KdaMoeProcessor

    return KdaMoeProcessor.from_package()


def assistant_turn(processor, index):
    """(prompt up to the assistant turn `index`, the rendered turn itself)."""
    prompt = processor.apply_chat_template(CONVERSATION[:index], tools=WEATHER_TOOLS, add_generation_prompt=True)
    full = processor.apply_chat_template(CONVERSATION[: index + 1], tools=WEATHER_TOOLS)
    assert full.startswith(prompt)
    return prompt, full[len(prompt) :]


def test_chat_template_renders_tool_declarations_calls_and_results_in_kimi_format(processor):
    import re

    text = processor.apply_chat_template(CONVERSATION, tools=WEATHER_TOOLS)
    declared = re.match(r"<\|im_system\|>tool_declare<\|im_middle\|>(.*?)<\|im_end\|>", text)
    assert json.loads(declared[1]) == WEATHER_TOOLS
    _, turn = assistant_turn(processor, 2)
    assert turn == (
        "Let me check.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
        "<|tool_call_end|>"
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "東京"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    results = re.findall(r"<\|im_system\|>tool<\|im_middle\|>## Return of (\S+)\n(.*?)<\|im_end\|>", text)
    assert results == [(m["tool_call_id"], m["content"]) for m in CONVERSATION if m["role"] == "tool"]


@pytest.mark.parametrize("index", [2, 5])
def test_assistant_turns_parse_back_to_the_messages_they_render(processor, index):
    prompt, turn = assistant_turn(processor, index)
    parsed = processor.parse_response(turn, prefix=prompt)
    assert parsed == CONVERSATION[index]
    # from the token ids generate() returns, as a serving loop gets them
    tokenizer = processor.tokenizer
    ids = tokenizer.encode(turn, add_special_tokens=False)
    assert processor.parse_response(ids, prefix=tokenizer.encode(prompt, add_special_tokens=False)) == parsed


def test_tool_call_arguments_are_cast_by_the_tool_schema(processor):
    prompt, turn = assistant_turn(processor, 2)
    turn = turn.replace('"days": 3', '"days": "3"')  # a model that quotes a number
    parsed = processor.parse_response(turn, prefix=prompt, tools=WEATHER_TOOLS)
    assert parsed["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("index", [2, 5])
def test_kimi_tiktoken_tokenizer_renders_the_chat_template_with_tools_and_parses_turns_back(kimi_folder, index):
    """The Kimi tokenizer folder with the package's `chat_template.jinja` beside it: every markup token of a rendered
    conversation with tool declarations, calls and results is one special id, the ids decode to the text, and an
    assistant turn's ids parse back to its message."""
    import re
    import shutil

    from kda_moe.processing import kimi_tiktoken_tokenizer
    from kda_moe.processing.processing_kda_moe import CHAT_TEMPLATE_FILE

    shutil.copy(CHAT_TEMPLATE_FILE, kimi_folder / "chat_template.jinja")
    tokenizer = kimi_tiktoken_tokenizer(kimi_folder)
    text = tokenizer.apply_chat_template(CONVERSATION, tools=WEATHER_TOOLS, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    markup = re.findall(r"<\|[a-z_]+\|>", text)
    assert {"<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>", "<|im_system|>"} <= set(markup)
    special = {tokenizer.convert_tokens_to_ids(token) for token in KIMI_SPECIAL_TOKENS.values()}
    assert [i for i in ids if i in special] == tokenizer.convert_tokens_to_ids(markup)  # one id each, in order

    prompt = tokenizer.apply_chat_template(CONVERSATION[:index], tools=WEATHER_TOOLS, add_generation_prompt=True,
                                           tokenize=False)
    full = tokenizer.apply_chat_template(CONVERSATION[: index + 1], tools=WEATHER_TOOLS, tokenize=False)
    turn = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
    prefix = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.parse_response(turn, prefix=prefix) == CONVERSATION[index]
