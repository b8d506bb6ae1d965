"""KdaMoeImageProcessor / KdaMoeProcessor: placeholder expansion, sizes, inputs, errors, chat template, save/load."""

import tracemalloc

import numpy as np
import pytest
import torch
from multimodal_testing import PATCH, random_image, tiny_processor
from PIL import Image
from transformers import AutoProcessor

from kda_moe import KdaMoeImageProcessor, KdaMoeProcessor

IMAGE = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"


@pytest.fixture(scope="module")
def processor():
    return tiny_processor()


@pytest.mark.parametrize("size", [(17, 23), (31, 9), (9, 31), (50, 50), (13, 77), (101, 37)])
def test_placeholder_count_equals_merged_patch_count(processor, size):
    height, width = size
    out = processor(images=[random_image(height, width)], text=f"x{IMAGE}y", return_tensors="pt")
    t, grid_h, grid_w = out["image_grid_thw"][0].tolist()
    merge = processor.image_processor.merge_size
    assert t == 1 and grid_h % merge == 0 and grid_w % merge == 0
    assert grid_h * grid_w <= processor.image_processor.max_patches
    assert out["pixel_values"].shape == (grid_h * grid_w, 3 * PATCH * PATCH)
    assert int((out["input_ids"] == processor.image_token_id).sum()) == grid_h * grid_w // merge**2
    # aspect ratio kept within one merge step of the grid
    factor = PATCH * merge
    assert abs(grid_w * PATCH / (grid_h * PATCH) - width / height) <= factor / min(grid_h * PATCH, grid_w * PATCH) * 3


def test_expansion_follows_each_image_in_order_across_a_batch(processor):
    images = [random_image(16, 40, seed=1), random_image(40, 16, seed=2), random_image(24, 24, seed=3)]
    out = processor(images=images, text=[f"a{IMAGE}b{IMAGE}", f"c{IMAGE}"], padding=True, return_tensors="pt")
    counts = processor.num_image_tokens(out["image_grid_thw"])
    per_row = (out["input_ids"] == processor.image_token_id).sum(1).tolist()
    assert per_row == [counts[0] + counts[1], counts[2]]


def test_pil_numpy_and_torch_inputs_give_the_same_pixels():
    image_processor = KdaMoeImageProcessor(patch_size=PATCH, min_image_size=PATCH, max_patches=64)
    pil = random_image(21, 35, seed=4)
    hwc = np.asarray(pil)
    chw = torch.from_numpy(hwc.copy()).permute(2, 0, 1)
    reference = image_processor(pil)["pixel_values"]
    for other in (hwc, chw, chw.float() / 255):
        assert torch.allclose(image_processor(other)["pixel_values"], reference, atol=1e-5)
    gray = image_processor(pil.convert("L"))["pixel_values"].view(-1, 3, PATCH * PATCH)
    assert torch.equal(gray[:, 0], gray[:, 1])  # grayscale replicated into RGB
    rgba = image_processor(pil.convert("RGBA"))["pixel_values"]
    assert torch.allclose(rgba, reference, atol=1e-6)


def test_large_images_are_downscaled_into_the_patch_budget():
    image_processor = KdaMoeImageProcessor(patch_size=14, max_patches=256)
    height, width = image_processor.target_size(3000, 1000)
    assert height % 28 == 0 and width % 28 == 0 and (height // 14) * (width // 14) <= 256
    assert abs(height / width - 3) < 0.5
    assert image_processor.get_number_of_image_patches(3000, 1000) == (height // 14) * (width // 14)


def test_huge_pil_images_are_reduced_before_any_full_resolution_array_is_made():
    image_processor = KdaMoeImageProcessor(patch_size=14, max_patches=256)
    huge = random_image(40, 60, seed=5).resize((3000, 2000), Image.Resampling.BICUBIC)  # 3000 wide, 2000 high
    full_resolution_bytes = 2000 * 3000 * 3  # one uint8 array of it; its float32 tensor is 4x that
    tracemalloc.start()
    try:
        reduced = image_processor(huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < full_resolution_bytes / 4, peak
    resized_at_full_resolution = image_processor(np.asarray(huge))
    assert torch.equal(reduced["image_grid_thw"], resized_at_full_resolution["image_grid_thw"])
    difference = (reduced["pixel_values"] - resized_at_full_resolution["pixel_values"]).abs()  # values in [-1, 1]
    assert difference.mean() < 0.01 and difference.max() < 0.1


@pytest.mark.parametrize("size", [(224, 224), (600, 900)], ids=["no_resize", "downscaled_less_than_four_times"])
def test_pil_images_below_the_reduction_threshold_give_exactly_the_array_pixels(size):
    image_processor = KdaMoeImageProcessor(patch_size=14, max_patches=256)
    image = random_image(*size, seed=6)
    assert torch.equal(image_processor(image)["pixel_values"], image_processor(np.asarray(image))["pixel_values"])


@pytest.mark.parametrize(
    "images, text, message",
    [
        ([random_image(20, 20)], f"{IMAGE}{IMAGE}", "2 `<|media_pad|>` image placeholder"),
        ([random_image(20, 20), random_image(20, 20)], f"{IMAGE}", "remove the extra images"),
        ([random_image(20, 20)], "no placeholder", "put one `<|media_pad|>` per image"),
        (None, f"{IMAGE}", "pass the images"),
        ([random_image(20, 20)], None, "Images came without text"),
    ],
    ids=["more_placeholders", "more_images", "no_placeholder", "no_images", "no_text"],
)
def test_image_placeholder_mismatches_raise_value_errors(processor, images, text, message):
    with pytest.raises(ValueError, match=message):
        processor(images=images, text=text)


def test_too_small_bomb_sized_elongated_and_non_image_inputs_raise_value_errors(processor):
    with pytest.raises(ValueError, match="at least min_image_size"):
        processor(images=[random_image(2, 30)], text=IMAGE)
    bomb = torch.zeros(3, 1, 1, dtype=torch.uint8).expand(3, 20_000, 20_000)  # 400 megapixels, no memory
    with pytest.raises(ValueError, match="decompression bomb"):
        KdaMoeImageProcessor()(bomb)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(images=[random_image(8, 4000)], text=IMAGE)
    for not_an_image in (42, {"pixels": 1}, np.array(["a", "b"]), torch.zeros(2, 5, 5, 5)):
        with pytest.raises(ValueError, match="image|Expected|channel"):
            processor(images=[not_an_image], text=IMAGE)
    with pytest.raises(ValueError, match="Could not load an image"):
        processor(images=["/nonexistent/cat.png"], text=IMAGE)


def test_truncation_that_cuts_an_image_raises(processor):
    with pytest.raises(ValueError, match="truncation"):
        processor(images=[random_image(40, 40)], text=f"hello {IMAGE}", truncation=True, max_length=5)


def test_chat_template_covers_roles_images_and_tool_calls(processor):
    messages = [
        {"role": "system", "content": "You see images."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Zoom in."}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "zoom", "arguments": {"factor": 2}}}]},
        {"role": "tool", "tool_call_id": "functions.zoom:0", "content": "zoomed"},
        {"role": "assistant", "content": "It is a cat."},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]
    prompt = processor.apply_chat_template(messages, tools=tools)
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>")
    for piece in ("<|im_system|>system<|im_middle|>You see images.<|im_end|>", f"<|im_user|>user<|im_middle|>{IMAGE}",
                  '<|tool_calls_section_begin|><|tool_call_begin|>functions.zoom:0<|tool_call_argument_begin|>'
                  '{"factor": 2}<|tool_call_end|><|tool_calls_section_end|>', "<|im_system|>tool<|im_middle|>",
                  "<|im_assistant|>assistant<|im_middle|>It is a cat.<|im_end|>"):  # fmt: skip
        assert piece in prompt, piece
    generation = processor.apply_chat_template(messages[:2], add_generation_prompt=True)
    assert generation.endswith("<|im_assistant|>assistant<|im_middle|>")


def test_apply_chat_template_with_image_content_returns_model_inputs(processor):
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(30, 20)},
                                             {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    out = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert set(out) >= {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"}
    assert int((out["input_ids"] == processor.image_token_id).sum()) == processor.num_image_tokens(
        out["image_grid_thw"]
    )[0]


def test_processor_save_and_auto_load_round_trip(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists() and (tmp_path / "processing_kda_moe.py").exists()
    reloaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(reloaded) is KdaMoeProcessor and type(reloaded.image_processor) is KdaMoeImageProcessor
    assert reloaded.image_processor.to_dict() == processor.image_processor.to_dict()
    assert reloaded.chat_template == processor.chat_template
    image = random_image(25, 33, seed=5)
    a = processor(images=[image], text=f"hi {IMAGE}", return_tensors="pt")
    b = reloaded(images=[image], text=f"hi {IMAGE}", return_tensors="pt")
    assert all(torch.equal(a[key], b[key]) for key in a)
