"""Loading a model too big for one device: `device_map="auto"` with CPU and disk offload of a sharded checkpoint,
the Kimi K3 shapes built on the meta device and placed by `infer_auto_device_map`, tensor / expert parallel loading
of a sharded checkpoint on 2 gloo ranks, and the peak host memory of each way of loading (benchmarks/load_memory.py).
"""

import re

import pytest
import torch
from conftest import tiny_model
from multimodal_testing import random_image, tiny_multimodal_model, tiny_processor
from test_decoding import randomize_balancing_and_depth_mixing
from test_multimodal_generation import chat_inputs

from kda_moe import (
    KdaMoeConfig,
    KdaMoeForCausalLM,
    KdaMoeForConditionalGeneration,
    KdaMoeTextConfig,
    KdaMoeVisionConfig,
)

GB = 10**9


def save_sharded(model, folder, shards=4):
    """`save_pretrained` in at least `shards` safetensors files, with their index."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=f"{total // (shards * 1000)}KB")
    assert len(list(folder.glob("model-*.safetensors"))) >= shards and (folder / "model.safetensors.index.json").exists()


def assert_whole_blocks(device_map, block_prefixes):
    """No module inside a decoder layer (or vision block) is placed on its own: each block has one device."""
    for name in device_map:
        for prefix in block_prefixes:
            assert not re.match(rf"{re.escape(prefix)}\.\d+\.", name), f"{name} splits a block of {prefix}"


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_offloaded_decoder_layers_generate_the_tokens_of_the_loaded_model(tmp_path, tie_word_embeddings):
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, tie_word_embeddings=tie_word_embeddings))
    save_sharded(model, tmp_path / "model")
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    budget = sizes["model.embed_tokens"] + sizes["model.layers.0"] + sizes["model.layers.1"] + sizes["model.layers.2"]
    offloaded = KdaMoeForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    )
    device_map = offloaded.hf_device_map
    layers = {name: device for name, device in device_map.items() if name.startswith("model.layers.")}
    assert {"cpu", "disk"} <= set(layers.values()), device_map
    assert_whole_blocks(device_map, ["model.layers"])
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # the disk layers stay off memory
    if tie_word_embeddings:
        assert offloaded.lm_head.weight is offloaded.model.embed_tokens.weight
    # Quantile Balancing biases (buffers) load with their layer, offloaded or not
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(offloaded.get_buffer(name), bias), name

    offloaded.generation_config.eos_token_id = None
    input_ids = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(offloaded(input_ids).logits, model(input_ids).logits, rtol=1e-5, atol=1e-6)
    expected = model.generate(input_ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(offloaded.generate(input_ids, max_new_tokens=6, do_sample=False), expected)


def test_offloaded_multimodal_model_generates_the_tokens_of_the_loaded_model(tmp_path):
    model = randomize_balancing_and_depth_mixing(tiny_multimodal_model(seed=0))
    save_sharded(model, tmp_path / "model")
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    text = "model.language_model"
    budget = sizes[f"{text}.embed_tokens"] + sizes["model.vision_tower"] + sizes["model.multi_modal_projector"]
    budget += sizes[f"{text}.layers.0"] + sizes[f"{text}.layers.1"]
    budget += sizes["lm_head"]  # accelerate keeps room for the largest leaf (the embedding) on the main device
    offloaded = KdaMoeForConditionalGeneration.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    )
    device_map = offloaded.hf_device_map
    layers = {name: device for name, device in device_map.items() if name.startswith(f"{text}.layers.")}
    assert {"cpu", "disk"} <= set(layers.values()), device_map
    assert_whole_blocks(device_map, [f"{text}.layers", "model.vision_tower.blocks"])

    processor = tiny_processor(model)
    inputs = chat_inputs(processor, [random_image(23, 37, seed=0)])
    offloaded.generation_config.eos_token_id = None
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert torch.equal(offloaded.generate(**inputs, max_new_tokens=5, do_sample=False), expected)
