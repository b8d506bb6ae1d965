"""Loading a model too big for one device: `device_map="auto"` with CPU and disk offload of a sharded checkpoint,
the Kimi K3 shapes built on the meta device and placed by `infer_auto_device_map`, tensor / expert parallel loading
of a sharded checkpoint on 2 gloo ranks, and the peak host memory of each way of loading (benchmarks/load_memory.py).
"""

import re
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import compute_module_sizes
from conftest import tiny_model
from multimodal_testing import random_image, tiny_multimodal_model, tiny_processor
from test_decoding import randomize_balancing_and_depth_mixing
from test_multimodal_generation import chat_inputs

from kda_moe import KdaMoeForCausalLM, KdaMoeForConditionalGeneration
from kda_moe.compat import EXPERT_TOKEN_DISPATCH

# benchmarks/ on the path as for the script itself: the processes it spawns import `load_memory` by name
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import load_memory  # noqa: E402

GB = 10**9


def save_sharded(model, folder, shards=4):
    """`save_pretrained` in at least `shards` safetensors files, with their index."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=f"{total // (shards * 1000)}KB")
    assert len(list(folder.glob("model-*.safetensors"))) >= shards
    assert (folder / "model.safetensors.index.json").exists()


def assert_whole_blocks(device_map, block_prefixes):
    """No module inside a decoder layer (or vision block) is placed on its own: each block has one device."""
    for name in device_map:
        for prefix in block_prefixes:
            assert not re.match(rf"{re.escape(prefix)}\.\d+\.", name), f"{name} splits a block of {prefix}"


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_offloaded_decoder_layers_generate_the_tokens_of_the_loaded_model(tmp_path, tie_word_embeddings):
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, tie_word_embeddings=tie_word_embeddings))
    save_sharded(model, tmp_path / "model")
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
    static = offloaded.generate(input_ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(static, expected)  # the static cache allocates each layer's states where the layer runs


@pytest.mark.parametrize("vision_on_disk", [False, True])
def test_offloaded_multimodal_model_generates_the_tokens_of_the_loaded_model(tmp_path, vision_on_disk):
    model = randomize_balancing_and_depth_mixing(tiny_multimodal_model(seed=0, text_config=dict(mla_use_nope=False)))
    save_sharded(model, tmp_path / "model")
    sizes = compute_module_sizes(model)
    text = "model.language_model"
    budget = sizes["lm_head"]  # accelerate keeps room for the largest leaf (the embedding) on the main device
    budget += sizes["model.vision_tower.patch_embed"]
    if not vision_on_disk:
        budget += sizes["model.vision_tower"] + sizes["model.multi_modal_projector"] + sizes[f"{text}.embed_tokens"]
        budget += sizes[f"{text}.layers.0"] + sizes[f"{text}.layers.1"]
    offloaded = KdaMoeForConditionalGeneration.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    )
    device_map = offloaded.hf_device_map
    assert_whole_blocks(device_map, [f"{text}.layers", "model.vision_tower.blocks"])
    placed = {name: device for name, device in device_map.items() if name.startswith(("model.vision_tower", text))}
    if vision_on_disk:  # the vision blocks, the projector and the whole text model (rotary tables included) on disk
        assert placed["model.vision_tower.blocks"] == placed[text] == "disk"
        assert device_map["model.multi_modal_projector"] == "disk"
    else:
        layers = {name: device for name, device in placed.items() if name.startswith(f"{text}.layers.")}
        assert {"cpu", "disk"} <= set(layers.values()) and placed["model.vision_tower"] == "cpu", device_map

    processor = tiny_processor(model)
    inputs = chat_inputs(processor, [random_image(23, 37, seed=0)])
    offloaded.generation_config.eos_token_id = None
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert torch.equal(offloaded.generate(**inputs, max_new_tokens=5, do_sample=False), expected)


def test_kimi_k3_builds_on_the_meta_device_and_places_whole_layers_on_eight_devices():
    """Counting rule: parameters only (router biases are buffers); embeddings and the untied lm_head counted once
    each. Activated per token = everything except the routed experts a token does not select (top-16 of 896). Both
    K3 models build on the meta device without holding memory; `infer_auto_device_map` onto 8 x 141 GB, CPU and disk
    places every module, never splits a decoder layer or vision block, and fills the devices in layer order."""
    before = load_memory.reset_peak_rss()
    plans = load_memory.kimi_k3_device_plan(devices=8, device_bytes=141 * GB)
    assert load_memory.resident_bytes("VmHWM") - before < 1 * GB  # 2.8T parameters on meta: no storage

    model = plans["text"]["model"]
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    activated = total - routed + routed * config.num_experts_per_tok // config.num_experts
    assert config.layer_types.count("linear_attention") == 69 and config.layer_types.count("full_attention") == 24
    assert config.layer_types[-2:] == ["full_attention", "full_attention"]
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok) == (7168, 896, 16)
    assert abs(total / 2.78e12 - 1) < 0.01, total
    assert abs(activated / 104e9 - 1) < 0.02, activated

    order = [*range(8), "cpu", "disk"]
    for name, plan in plans.items():
        model, device_map = plan["model"], plan["device_map"]
        assert all(p.device.type == "meta" for p in model.parameters())
        text = "model.language_model" if name == "multimodal" else "model"
        assert_whole_blocks(device_map, [f"{text}.layers", "model.vision_tower.blocks"])
        for param_name, _ in model.named_parameters():
            assert any(param_name.startswith(f"{module}.") for module in device_map), f"{param_name} is not placed"
        layer_devices = [device_map[f"{text}.layers.{i}"] for i in range(config.num_hidden_layers)]
        assert [order.index(d) for d in layer_devices] == sorted(order.index(d) for d in layer_devices)
        assert set(range(8)) <= set(layer_devices)  # every device holds at least one whole layer
        assert all(plan["bytes"][index] <= 141 * GB for index in range(8))
        assert sum(plan["bytes"].values()) == plan["total"]
        if name == "multimodal":
            assert device_map["model.vision_tower"] == device_map["model.multi_modal_projector"] == 0


@pytest.fixture(scope="module")
def load_measurements(tmp_path_factory):
    """benchmarks/load_memory.py on a 300 MB checkpoint of 7 shards: plain, offloaded, and 2-rank TP / EP loads."""
    workdir = tmp_path_factory.mktemp("load_memory")
    checkpoint_bytes = load_memory.write_checkpoint(workdir / "model", size_mb=300)
    assert len(list((workdir / "model").glob("model-*.safetensors"))) >= 6
    results = load_memory.measure(workdir / "model", workdir)
    return checkpoint_bytes, {(r["mode"], r["rank"]): r for r in results}


def test_loading_streams_the_shards_instead_of_holding_a_second_copy(load_measurements):
    checkpoint_bytes, results = load_measurements
    plain, offload = results["plain", 0], results["offload", 0]
    assert plain["parameter_bytes"] >= 0.99 * checkpoint_bytes
    assert plain["peak_growth"] < 1.25 * checkpoint_bytes  # the model itself, not the model plus a state dict
    assert "disk" in offload["devices"] and offload["parameter_bytes"] < 0.1 * checkpoint_bytes
    assert offload["peak_growth"] < 0.25 * checkpoint_bytes  # the disk layers are never resident all at once
    torch.testing.assert_close(offload["logits"], plain["logits"], rtol=0, atol=0)


def test_tensor_and_expert_parallel_load_gives_the_single_process_logits_with_half_the_parameters(load_measurements):
    checkpoint_bytes, results = load_measurements
    plain = results["plain", 0]
    for rank in range(load_memory.WORLD_SIZE):
        run = results["tp2", rank]
        torch.testing.assert_close(run["logits"], plain["logits"], rtol=1e-4, atol=1e-5)
        assert 0.45 < run["parameter_bytes"] / plain["parameter_bytes"] < 0.6, run["parameter_bytes"]
        # transformers 5.19+ reads each rank's slices from the shards; 5.17's tensor-parallel load (routed experts
        # split by the TP plan, no EP on one group) peaks at about 1.5 x the checkpoint on every rank
        if EXPERT_TOKEN_DISPATCH:
            assert run["peak_growth"] < 0.75 * checkpoint_bytes, run["peak_growth"]
