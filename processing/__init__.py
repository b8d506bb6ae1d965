"""Processing: `KdaMoeImageProcessor`, `KdaMoeProcessor` (with `chat_template.jinja`) and the shipped tokenizer
(`tokenizer/`, trained by `train_tokenizer.py` on the bundled `tokenizer/corpus.txt`)."""

from .image_processing_kda_moe import KdaMoeImageProcessor
from .kimi_tiktoken import KIMI_PATTERN, kimi_tiktoken_tokenizer
from .processing_kda_moe import CHAT_TEMPLATE_FILE, TOKENIZER_DIR, KdaMoeProcessor

__all__ = [
    "KdaMoeImageProcessor",
    "KdaMoeProcessor",
    "TOKENIZER_DIR",
    "CHAT_TEMPLATE_FILE",
    "KIMI_PATTERN",
    "kimi_tiktoken_tokenizer",
]
