"""Train the tokenizer shipped in `kda_moe/processing/tokenizer/` (deterministic; no network).

    python -m kda_moe.processing.train_tokenizer [--output-dir DIR] [--vocab-size 1024]

Byte-level BPE (`tokenizers`) trained on `tokenizer/corpus.txt`, a small original corpus bundled with the package
(captions, chat turns, code, JSON, numbers and text in many scripts). Byte-level means every byte sequence has a
tokenization, so any Unicode string round-trips through encode/decode exactly; no normalizer runs. The special
tokens come first (ids 0, 1, 2, ... in the order of `SPECIAL_TOKENS`) and are matched atomically before BPE. The
default vocabulary (1024) equals `KdaMoeTextConfig().vocab_size`, so the default configs and this tokenizer fit.

Run twice, it writes byte-identical files (`tests/test_tokenizer.py` checks that it reproduces the shipped ones).
"""

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT_DIR = HERE / "tokenizer"
CORPUS = DEFAULT_OUTPUT_DIR / "corpus.txt"
VOCAB_SIZE = 1024

PAD, BOS, EOS, UNK = "[PAD]", "[BOS]", "[EOS]", "[UNK]"
ROLE_TOKENS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_tool|>", "<|im_middle|>"]
END_OF_TURN = "<|im_end|>"
MEDIA_TOKENS = ["<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]
TOOL_TOKENS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *MEDIA_TOKENS, *ROLE_TOKENS, END_OF_TURN, *TOOL_TOKENS]
# Named tokens the processor and chat template read (`tokenizer.image_token`, ...).
NAMED_SPECIAL_TOKENS = {
    "image_token": "<|media_pad|>",
    "media_start_token": "<|media_start|>",
    "media_content_token": "<|media_content|>",
    "media_end_token": "<|media_end|>",
    "end_of_turn_token": END_OF_TURN,
}


def train(corpus: Path = CORPUS, vocab_size: int = VOCAB_SIZE):
    """The `tokenizers.Tokenizer` trained on `corpus` (one training thread: deterministic merges)."""
    import os

    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tokenizer


def save(tokenizer, output_dir: Path) -> None:
    """Write `tokenizer.json` (sorted keys) and `tokenizer_config.json`, loadable by `AutoTokenizer` (5.17+)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    spec = json.loads(tokenizer.to_str())
    (output_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=1, sort_keys=True) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "extra_special_tokens": NAMED_SPECIAL_TOKENS,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (PAD, BOS, EOS, UNK)],
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1048576,
        "padding_side": "left",
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    tokenizer = train(args.corpus, args.vocab_size)
    save(tokenizer, args.output_dir)
    print(f"wrote {args.output_dir} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
