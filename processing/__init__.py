"""Processing: `KdaMoeImageProcessor`, `KdaMoeProcessor` (with `chat_template.jinja`, and `KIMI_RESPONSE_TEMPLATE`
to parse generated assistant turns back), the shipped tokenizer (`tokenizer/`, trained by `train_tokenizer.py` on the
bundled `tokenizer/corpus.txt`) and `kimi_tiktoken_tokenizer`, which converts Kimi's published tiktoken files."""

from .image_processing_kda_moe import KdaMoeImageProcessor
from .kimi_tiktoken import KIMI_PATTERN, kimi_tiktoken_tokenizer
from .processing_kda_moe import CHAT_TEMPLATE_FILE, KIMI_RESPONSE_TEMPLATE, TOKENIZER_DIR, KdaMoeProcessor

__all__ = [
    "KdaMoeImageProcessor",
    "KdaMoeProcessor",
    "TOKENIZER_DIR",
    "CHAT_TEMPLATE_FILE",
    "KIMI_PATTERN",
    "KIMI_RESPONSE_TEMPLATE",
    "kimi_tiktoken_tokenizer",
]
