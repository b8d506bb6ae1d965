"""`KdaMoeProcessor`: tokenizer + `KdaMoeImageProcessor` + the chat template (`chat_template.jinja`).

`processor(images=..., text=...)` expands the i-th `<|media_pad|>` of the text into as many `<|media_pad|>` tokens
as image i has merged patches (`grid_h * grid_w / merge_size**2`), so the model can scatter one image feature per
placeholder. Every mismatch between images and placeholders raises a `ValueError` that says what to fix.
`apply_chat_template` (transformers' own) renders `chat_template.jinja`, collects the images of the messages and
calls the processor.

`KdaMoeProcessor.from_package()` builds the processor from the files shipped in this folder (the byte-level BPE
tokenizer trained by `train_tokenizer.py` and the chat template), so demos and tests never download anything. Its
tokenizer carries `KIMI_RESPONSE_TEMPLATE`, so `processor.parse_response(generated, prefix=prompt)` turns a generated
assistant turn, tool calls included, back into a message.
"""

from pathlib import Path

from transformers import AutoTokenizer
from transformers.image_processing_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

from ..remote_code import write_remote_code
from .image_processing_kda_moe import KdaMoeImageProcessor, flatten_images

HERE = Path(__file__).resolve().parent
TOKENIZER_DIR = HERE / "tokenizer"
CHAT_TEMPLATE_FILE = HERE / "chat_template.jinja"
# How transformers' `parse_response` reads an assistant turn of the chat format back into a message: the text before
# the tool-call section is `content`; each `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>JSON
# <|tool_call_end|>` becomes an OpenAI-style tool call (`id`, `type`, `function.name`, `function.arguments` as a dict).
KIMI_RESPONSE_TEMPLATE = {
    "version": 1,
    "start_anchor": "<|im_assistant|>assistant<|im_middle|>",
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {"close": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|im_end|>"]},
        "tool_calls": {
            "open_pattern": (
                r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^:<]+):\d+)\s*<\|tool_call_argument_begin\|>"
            ),
            "close": "<|tool_call_end|>",
            "content": "json",
            "repeats": True,
            "transform": {"id": "{id}", "type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}

# Keyword arguments of transformers' processor API that a plain image + text processor has no use for.
_IGNORED_KWARGS = (
    "videos_kwargs", "audio_kwargs", "audio_from_video_indices", "load_audio_from_video", "do_sample_frames",
    "return_mm_token_type_ids", "return_text_replacement_offsets", "return_metadata", "common_kwargs",
)  # fmt: skip

class KdaMoeProcessor(ProcessorMixin):
    r"""
    Args:
        image_processor ([`KdaMoeImageProcessor`]): images -> packed patches and grids.
        tokenizer: a tokenizer whose vocabulary holds `<|media_pad|>` (its `image_token`, if it names one).
        chat_template (`str`, *optional*): Jinja template; `from_package()` uses the shipped `chat_template.jinja`.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|media_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"The tokenizer has no {self.image_token!r} token; add it as a special token.")
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    @classmethod
    def from_package(cls, vision_config=None, **image_processor_kwargs) -> "KdaMoeProcessor":
        """The processor made of the files shipped with kda-moe (no download). With a `vision_config`, the image
        processor's `patch_size` / `merge_size` follow it."""
        if vision_config is not None:
            image_processor_kwargs.setdefault("patch_size", vision_config.patch_size)
            image_processor_kwargs.setdefault("merge_size", vision_config.spatial_merge_size)
        tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
        tokenizer.response_template = KIMI_RESPONSE_TEMPLATE
        return cls(
            image_processor=KdaMoeImageProcessor(**image_processor_kwargs),
            tokenizer=tokenizer,
            chat_template=CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"),
        )

    def num_image_tokens(self, image_grid_thw) -> list[int]:
        """Text tokens (merged patches) of each image of an `image_grid_thw` [num_images, 3]."""
        merge = self.image_processor.merge_size
        return [int(t * h * w) // merge**2 for t, h, w in image_grid_thw.tolist()]

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs) -> BatchFeature:
        if videos is not None or audio is not None:
            raise ValueError("KdaMoeProcessor handles images and text only; got videos or audio.")
        if images is None and text is None:
            raise ValueError("KdaMoeProcessor needs `text` (and optionally `images`); got neither.")
        for key in _IGNORED_KWARGS:
            kwargs.pop(key, None)
        images_kwargs = dict(kwargs.pop("images_kwargs", None) or {})
        text_kwargs = dict(kwargs.pop("text_kwargs", None) or {})
        for key in list(kwargs):
            if key in KdaMoeImageProcessor.CALL_KWARGS:
                images_kwargs[key] = kwargs.pop(key)
        text_kwargs.update(kwargs)
        return_tensors = text_kwargs.pop("return_tensors", None)

        if text is None:
            raise ValueError(
                "Images came without text. Pass `text` with one `<|media_pad|>` placeholder per image, e.g. "
                "processor.apply_chat_template(messages) with {'type': 'image'} content blocks."
            )
        texts = [text] if isinstance(text, str) else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f"`text` must be a string or a list of strings, got {type(text).__name__}.")
        placeholders = [t.count(self.image_token) for t in texts]
        images = [] if images is None else flatten_images(images)

        if sum(placeholders) != len(images):
            if not images:
                fix = "pass the images (images=[...]) or remove the placeholders"
            elif sum(placeholders) == 0:
                fix = (
                    f"put one `{self.image_token}` per image in the text (apply_chat_template does it for "
                    "{'type': 'image'} blocks)"
                )
            elif sum(placeholders) > len(images):
                fix = "pass one image per placeholder or remove the extra placeholders"
            else:
                fix = "remove the extra images or add one placeholder per image"
            raise ValueError(
                f"The text has {sum(placeholders)} `{self.image_token}` image placeholder(s) (per sample: "
                f"{placeholders}) but {len(images)} image(s) were given; {fix}."
            )

        image_inputs = {}
        if images:
            image_inputs = self.image_processor(images, return_tensors="pt", **images_kwargs)
            counts = iter(self.num_image_tokens(image_inputs["image_grid_thw"]))
            expanded = []
            for t in texts:
                pieces = t.split(self.image_token)
                out = pieces[0]
                for piece in pieces[1:]:
                    out += self.image_token * next(counts) + piece
                expanded.append(out)
            texts = expanded

        text_inputs = self.tokenizer(texts, **text_kwargs)
        expected = sum(self.num_image_tokens(image_inputs["image_grid_thw"])) if images else 0
        found = sum(list(ids).count(self.image_token_id) for ids in text_inputs["input_ids"])
        if found != expected:
            raise ValueError(
                f"After tokenization the text holds {found} `{self.image_token}` tokens but the images need "
                f"{expected}; truncation (max_length) cut into an image. Raise max_length or pass fewer images."
            )
        return BatchFeature(data={**text_inputs, **image_inputs}, tensor_type=return_tensors)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def post_process_image_text_to_text(
        self, generated_outputs, skip_special_tokens=True, clean_up_tokenization_spaces=False, **kwargs
    ):
        return self.tokenizer.batch_decode(
            generated_outputs,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            **kwargs,
        )

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", *self.image_processor.model_input_names]

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`ProcessorMixin.save_pretrained`, plus the package source the processor runs (flattened, named by the
        `auto_map` of `processor_config.json` and of its image processor entry), so `AutoProcessor` and
        `AutoImageProcessor` `.from_pretrained(folder, trust_remote_code=True)` load it where kda_moe is not installed."""
        self.auto_map = write_remote_code(
            save_directory, {"AutoProcessor": KdaMoeProcessor, "AutoImageProcessor": KdaMoeImageProcessor}
        )
        self.image_processor.auto_map = {"AutoImageProcessor": self.auto_map["AutoImageProcessor"]}
        return super().save_pretrained(save_directory, *args, **kwargs)


__all__ = ["KIMI_RESPONSE_TEMPLATE", "KdaMoeProcessor"]
