"""Kimi's tiktoken-format tokenizer as a fast (`tokenizers`) tokenizer.

Kimi K2, Kimi Linear and Kimi K3 publish their tokenizer as `tiktoken.model` (one `base64(token bytes) rank` line per
BPE token) plus a `tokenizer_config.json` whose `added_tokens_decoder` names the special tokens, with remote code that
runs it through `tiktoken`. `kimi_tiktoken_tokenizer(folder)` converts those files with transformers' own
`TikTokenConverter` (byte-level BPE, merges recovered from the ranks), using Kimi's pre-tokenization pattern and
Kimi's special-token ids, so the result encodes as Kimi's tokenizer does and saves as an ordinary `tokenizer.json`;
it parses generated assistant turns with `KIMI_RESPONSE_TEMPLATE` (`tokenizer.parse_response`).
transformers reads the rank file with the `tiktoken` package (`pip install kda-moe[k3]`).
"""

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from .processing_kda_moe import KIMI_RESPONSE_TEMPLATE

TIKTOKEN_FILE = "tiktoken.model"
# The pre-tokenization pattern of Kimi's `tokenization_kimi.py`: Han runs on their own, letters split by case (Han
# excluded by class intersection), numbers in groups of up to three digits, punctuation runs, whitespace.
LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?" + LETTERS_UPPER + "*" + LETTERS_LOWER + "+" + CONTRACTIONS,
        r"[^\r\n\p{L}\p{N}]?" + LETTERS_UPPER + "+" + LETTERS_LOWER + "*" + CONTRACTIONS,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# Kimi reserves this many ids after the BPE ranks for special tokens; those the config does not name are
# `<|reserved_token_{id}|>`.
NUM_RESERVED_SPECIAL_TOKENS = 256
# `tokenizer_config.json` keys passed on to the fast tokenizer.
TOKENIZER_KWARGS = (
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "additional_special_tokens",
    "chat_template",
    "model_max_length",
    "clean_up_tokenization_spaces",
    "padding_side",
)


def token_content(token) -> str:
    """A token of `tokenizer_config.json`: a string or a serialized `AddedToken` (`{"content": ..., ...}`)."""
    return token["content"] if isinstance(token, dict) else token


def kimi_tiktoken_tokenizer(folder) -> PreTrainedTokenizerFast:
    """The fast tokenizer of a Kimi tokenizer folder (`tiktoken.model` + `tokenizer_config.json`, optionally
    `chat_template.jinja`). Special tokens get the ids `added_tokens_decoder` gives them, which must lie in the
    reserved block right after the BPE ranks."""
    folder = Path(folder)
    vocab_file = folder / TIKTOKEN_FILE
    config_file = folder / "tokenizer_config.json"
    for file in (vocab_file, config_file):
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: a Kimi tokenizer folder holds {TIKTOKEN_FILE} and {config_file.name}."
            )
    try:
        import tiktoken  # noqa: F401  (transformers' TikTokenConverter reads the rank file with it)
    except ImportError as error:
        raise ImportError(
            f"Reading {TIKTOKEN_FILE} needs the `tiktoken` package: `pip install kda-moe[k3]` (or "
            "`pip install tiktoken`)."
        ) from error
    config = json.loads(config_file.read_text(encoding="utf-8"))

    base_vocab_size = len(TikTokenConverter.load_tiktoken_bpe(str(vocab_file)))
    reserved = range(base_vocab_size, base_vocab_size + NUM_RESERVED_SPECIAL_TOKENS)
    special = {int(index): token_content(token) for index, token in config.get("added_tokens_decoder", {}).items()}
    outside = sorted(index for index in special if index not in reserved)
    if outside:
        raise ValueError(
            f"{config_file} gives special tokens the ids {outside}, outside the {NUM_RESERVED_SPECIAL_TOKENS} ids "
            f"[{reserved.start}, {reserved.stop}) reserved after the {base_vocab_size} BPE ranks of {vocab_file}; "
            "the two files do not belong together."
        )
    special_tokens = [special.get(index, f"<|reserved_token_{index}|>") for index in reserved]
    tokenizer_object = TikTokenConverter(
        vocab_file=str(vocab_file), pattern=KIMI_PATTERN, extra_special_tokens=special_tokens
    ).converted()

    kwargs = {key: config[key] for key in TOKENIZER_KWARGS if key in config}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if key in kwargs:
            kwargs[key] = token_content(kwargs[key])
    template_file = folder / "chat_template.jinja"
    if "chat_template" not in kwargs and template_file.is_file():
        kwargs["chat_template"] = template_file.read_text(encoding="utf-8")
    kwargs["response_template"] = config.get("response_template", KIMI_RESPONSE_TEMPLATE)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **kwargs)


__all__ = ["KIMI_PATTERN", "kimi_tiktoken_tokenizer"]
