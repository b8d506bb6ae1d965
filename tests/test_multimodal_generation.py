"""KdaMoeForConditionalGeneration: image + text decoding through the cache, save/load round trips, remote code,
pipeline("image-text-to-text"), placeholder errors, and a tiny model overfitting captions on CPU."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from multimodal_testing import random_image, tiny_multimodal_model, tiny_processor
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, DynamicCache

from kda_moe import KdaMoeForConditionalGeneration
from kda_moe.compat import output_cache


def randomize(model, seed=1):
    """Non-zero AttnRes pseudo-queries and position table, so the tests see non-trivial mixing and positions."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("res.proj.weight") or name.endswith("pos_emb.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def model():
    return randomize(tiny_multimodal_model(seed=0))


@pytest.fixture(scope="module")
def processor(model):
    return tiny_processor(model)


def chat_inputs(processor, images, question="What is in the picture?"):
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


def test_image_generation_through_the_cache_matches_full_forward_logits(model, processor):
    inputs = chat_inputs(processor, [random_image(23, 37, seed=0), random_image(30, 18, seed=1)])
    assert inputs["image_grid_thw"].shape == (2, 3)
    with torch.no_grad():
        generated = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        sequences = generated.sequences
        prompt_len = inputs["input_ids"].shape[1]
        full = model(sequences, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
    assert sequences.shape[1] == prompt_len + 6
    for step, step_logits in enumerate(generated.logits):
        assert (step_logits - full[:, prompt_len - 1 + step]).abs().max() < 1e-4, step


def test_manual_decoding_with_images_only_at_prefill_matches_full_forward(model, processor):
    inputs = chat_inputs(processor, [random_image(29, 29, seed=2)])
    ids = inputs["input_ids"]
    extra = torch.randint(20, model.config.text_config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    full_ids = torch.cat([ids, extra], dim=1)
    with torch.no_grad():
        full = model(full_ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
        cache = DynamicCache(config=model.config.get_text_config())
        out = model(ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"], cache=cache,
                    use_cache=True)  # fmt: skip
        logits = [out.logits]
        cache = output_cache(out)
        for i in range(extra.shape[1]):
            out = model(extra[:, i : i + 1], cache=cache, use_cache=True)
            cache = output_cache(out)
            logits.append(out.logits)
    assert (torch.cat(logits, dim=1) - full).abs().max() < 1e-4


def test_batched_generation_with_different_images_per_sample(model, processor):
    first = chat_inputs(processor, [random_image(20, 40, seed=3)])
    second = chat_inputs(processor, [random_image(36, 20, seed=4), random_image(16, 16, seed=5)], question="Compare.")
    texts = [
        processor.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in (
            [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}],
            [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}],
        )
    ]
    images = [random_image(20, 40, seed=3), random_image(36, 20, seed=4), random_image(16, 16, seed=5)]
    batch = processor(images=images, text=texts, padding=True, return_tensors="pt")
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate(**batch, **kwargs)
        alone_first = model.generate(**first, **kwargs)
        alone_second = model.generate(**second, **kwargs)
    assert torch.equal(batched[0, -4:], alone_first[0, -4:])
    assert torch.equal(batched[1, -4:], alone_second[0, -4:])


@pytest.mark.parametrize("case", ["more_placeholders", "fewer_placeholders", "pixels_without_placeholders",
                                  "placeholders_without_pixels"])  # fmt: skip
def test_model_rejects_placeholder_feature_mismatches(model, processor, case):
    inputs = chat_inputs(processor, [random_image(24, 24, seed=6)])
    ids, pixels, grids = inputs["input_ids"], inputs["pixel_values"], inputs["image_grid_thw"]
    image_token = model.config.image_token_id
    if case == "more_placeholders":
        ids = torch.cat([ids, torch.tensor([[image_token]])], dim=1)
    elif case == "fewer_placeholders":
        ids = ids[:, ids[0] != image_token][:, :-1]
        ids = torch.cat([ids, torch.full((1, 3), image_token)], dim=1)
    elif case == "pixels_without_placeholders":
        ids = ids[:, ids[0] != image_token]
    else:
        pixels = grids = None
    with pytest.raises(ValueError, match="KdaMoeProcessor|pixel_values"):
        model(ids, pixel_values=pixels, image_grid_thw=grids)


def trained_once(model, processor):
    model.train()
    inputs = chat_inputs(processor, [random_image(24, 32, seed=7)])
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.1)
    return model.eval()


def test_save_then_auto_classes_round_trip_bit_exactly(tmp_path):
    model = trained_once(randomize(tiny_multimodal_model(seed=1)), tiny_processor())
    processor = tiny_processor(model)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)

    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    reprocessor = AutoProcessor.from_pretrained(tmp_path)
    assert type(reloaded) is KdaMoeForConditionalGeneration
    assert type(reprocessor) is type(processor) and reprocessor.chat_template == processor.chat_template
    original, loaded = model.state_dict(), reloaded.state_dict()
    assert original.keys() == loaded.keys()
    for name in original:
        assert original[name].dtype == loaded[name].dtype and torch.equal(original[name], loaded[name]), name

    image = random_image(27, 41, seed=8)
    inputs, reinputs = chat_inputs(processor, [image]), chat_inputs(reprocessor, [image])
    assert inputs.keys() == reinputs.keys()
    for key in inputs:
        assert torch.equal(inputs[key], reinputs[key]), key
    with torch.no_grad():
        # Bit-identical weights (above); differently aligned buffers may change CPU BLAS's last fp32 bit.
        assert (model(**inputs).logits - reloaded(**reinputs).logits).abs().max() < 1e-6
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "kda_moe" and saved["text_config"]["model_type"] == "kda_moe_text"


def test_auto_model_for_causal_lm_loads_a_multimodal_folder_as_the_generative_model(model, processor, tmp_path):
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is KdaMoeForConditionalGeneration
    reloaded.generation_config.eos_token_id = None
    inputs = chat_inputs(processor, [random_image(23, 19, seed=9)])
    settings = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert (model(**inputs).logits - reloaded(**inputs).logits).abs().max() < 1e-6
        assert torch.equal(model.generate(**inputs, **settings), reloaded.generate(**inputs, **settings))


def test_saved_folder_loads_with_trust_remote_code_without_importing_kda_moe(tmp_path):
    model = randomize(tiny_multimodal_model(seed=2))
    processor = tiny_processor(model)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    inputs = chat_inputs(processor, [random_image(22, 30, seed=9)])
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.save({"inputs": dict(inputs), "logits": expected}, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForImageTextToText, AutoProcessor
        assert "kda_moe" not in sys.modules
        model = AutoModelForImageTextToText.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
        processor = AutoProcessor.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
        data = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            logits = model(**data["inputs"]).logits
        assert (logits - data["logits"]).abs().max() < 1e-5
        print("remote-code-ok", type(model).__name__, type(processor).__name__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote-code-ok KdaMoeForConditionalGeneration KdaMoeProcessor" in result.stdout


def test_image_text_to_text_pipeline_runs_on_the_saved_folder(tmp_path):
    from transformers import pipeline

    model = tiny_multimodal_model(seed=3)
    model.save_pretrained(tmp_path)
    tiny_processor(model).save_pretrained(tmp_path)
    chat = pipeline("image-text-to-text", model=str(tmp_path), device="cpu")
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(26, 34, seed=10)},
                                             {"type": "text", "text": "Describe it."}]}]  # fmt: skip
    result = chat(text=messages, max_new_tokens=5, do_sample=False)
    reply = result[0]["generated_text"]
    assert isinstance(reply, list) and reply[-1]["role"] == "assistant" and isinstance(reply[-1]["content"], str)
    plain = chat(images=random_image(20, 20, seed=11), text="<|media_start|>image<|media_content|><|media_pad|>"
                 "<|media_end|>A photo of", max_new_tokens=3, do_sample=False)  # fmt: skip
    assert isinstance(plain[0]["generated_text"], str)


def test_tiny_model_overfits_image_captions_and_trains_the_vision_tower():
    """8 (image, caption) pairs whose captions only the image tells apart; loss on the caption tokens only. The
    text side is a 2-layer MLA + dense decoder (the fastest mix on CPU); the vision path is the full one."""
    from PIL import Image, ImageDraw

    start = time.perf_counter()
    dense_mla = dict(num_hidden_layers=2, layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2,
                     attn_res_block_size=None)  # fmt: skip
    model = tiny_multimodal_model(seed=0, text_config=dense_mla)
    processor = tiny_processor(model, max_patches=16)
    colors = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
    pairs = []
    for i, (name, rgb) in enumerate(colors.items()):
        for shape in ("square", "line"):
            image = Image.new("RGB", (16, 16), (255, 255, 255) if i % 2 else (0, 0, 0))
            ImageDraw.Draw(image).rectangle([2, 2, 13, 13] if shape == "square" else [0, 6, 15, 9], fill=rgb)
            pairs.append((image, f"a {name} {shape}"))
    prefix = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"
    texts = [prefix + caption + processor.tokenizer.eos_token for _, caption in pairs]
    batch = processor(images=[image for image, _ in pairs], text=texts, padding=True, return_tensors="pt")
    prefix_len = len(processor(images=[pairs[0][0]], text=prefix)["input_ids"][0])
    labels = batch["input_ids"].clone()
    for row, n_pad in enumerate((batch["attention_mask"] == 0).sum(1).tolist()):  # left padding
        labels[row, : n_pad + prefix_len] = -100

    tracked = {
        name: param.detach().clone()
        for name, param in model.named_parameters()
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for step in range(400):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05 or time.perf_counter() - start > 55:
            break
    elapsed = time.perf_counter() - start
    assert loss.item() < 0.1, (step, loss.item())
    assert elapsed < 60, elapsed
    moved = {name for name, before in tracked.items() if not torch.equal(before, model.get_parameter(name))}
    assert any(name.startswith("model.vision_tower.blocks.") for name in moved)
    assert {"model.vision_tower.patch_embed.proj.weight", "model.vision_tower.pos_emb.weight"} <= moved
    assert {"model.multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_2.weight"} <= moved
