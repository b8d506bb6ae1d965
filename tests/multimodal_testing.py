"""Shared helpers of the multimodal tests: a tiny vision + text model and a processor that fits it."""

import numpy as np
import torch
from conftest import tiny_config

PATCH = 4  # tiny patches keep the CPU tests fast; the code path is the one of 14-pixel patches


def tiny_multimodal_config(**overrides):
    from kda_moe import KdaMoeConfig, KdaMoeProcessor

    vocab_size = len(KdaMoeProcessor.from_package().tokenizer)
    text = tiny_config(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2).to_dict()
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH,
        pos_emb_height=6, pos_emb_width=6,
    )  # fmt: skip
    vision.update(overrides.pop("vision_config", {}))
    text.update(overrides.pop("text_config", {}))
    return KdaMoeConfig(text_config=text, vision_config=vision, **overrides)


def tiny_multimodal_model(seed: int = 0, **overrides):
    from kda_moe import KdaMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = KdaMoeForConditionalGeneration(tiny_multimodal_config(**overrides)).eval()
    model.generation_config.eos_token_id = None  # random weights: let every generation run its full length
    return model


def tiny_processor(model=None, **image_kwargs):
    from kda_moe import KdaMoeProcessor

    image_kwargs.setdefault("max_patches", 96)
    image_kwargs.setdefault("min_image_size", PATCH)
    vision_config = model.config.vision_config if model is not None else None
    if vision_config is None:
        image_kwargs.setdefault("patch_size", PATCH)
    return KdaMoeProcessor.from_package(vision_config=vision_config, **image_kwargs)


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
