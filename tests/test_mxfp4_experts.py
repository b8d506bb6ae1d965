"""Routed experts kept mxfp4 in memory (`routed_expert_format="mxfp4"`): loaded from a Kimi K3 folder whose experts
compressed-tensors packed, 4.25 bits a weight, the logits and gradients of the model that dequantizes them on load,
the Triton grouped kernel's path equal to the PyTorch one, and the published layout written back byte for byte.

The K3 folders come from test_k3_layout.py's writer (the published tensor names, experts packed by compressed-tensors
itself). fp32 tolerances 1e-5 (logits) and 1e-4 of a gradient's norm: both models compute in fp32 from the same decoded
weights, in other orders."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from test_k3_layout import (K3_CONFIG, k3_state_dict, model_inputs, mxfp4_quantization_config, pack_experts_mxfp4,
                            randomized_model, write_k3_folder)
from transformers import AutoConfig, AutoModelForImageTextToText

from kda_moe.compat import ConfigValidationError
from kda_moe.configuration import KdaMoeTextConfig

pytest.importorskip("compressed_tensors")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def k3_mxfp4(tmp_path_factory):
    """(K3 folder with mxfp4 experts, its state dict as written)."""
    folder = tmp_path_factory.mktemp("k3_mxfp4")
    (folder / "config.json").write_text(json.dumps(K3_CONFIG))
    model = randomized_model(AutoConfig.from_pretrained(folder))
    packed_state, _ = pack_experts_mxfp4(k3_state_dict(model))
    write_k3_folder(folder, packed_state, {**K3_CONFIG, "quantization_config": mxfp4_quantization_config()})
    return folder, packed_state


def load(folder, expert_format: str, backend: str = "auto"):
    config = AutoConfig.from_pretrained(folder)
    config.text_config.routed_expert_format = expert_format
    config.text_config.kernel_backend = backend
    model, info = AutoModelForImageTextToText.from_pretrained(folder, config=config, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def sparse_experts(model):
    return [layer.mlp.experts for layer in model.model.language_model.layers if hasattr(layer.mlp, "experts")]


def test_packed_experts_take_4_25_bits_a_weight_and_give_the_dequantized_models_logits(k3_mxfp4):
    folder, _ = k3_mxfp4
    packed, dense = load(folder, "mxfp4"), load(folder, "dense")
    text = packed.config.text_config
    E, I, latent = text.num_experts, text.moe_intermediate_size, text.routed_expert_hidden_size
    for experts in sparse_experts(packed):
        assert experts.gate_up_proj.dtype == torch.uint8 and not experts.gate_up_proj.requires_grad
        assert experts.gate_up_proj.shape == (E, 2 * I, latent // 2 + latent // 32)
        assert experts.down_proj.shape == (E, latent, I // 2 + I // 32)
        bits = 8 * (experts.gate_up_proj.numel() + experts.down_proj.numel()) / (3 * E * I * latent)
        assert bits == 4.25
    inputs = model_inputs()
    with torch.no_grad():
        torch.testing.assert_close(packed(**inputs).logits, dense(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_gradients_through_frozen_packed_experts_match_the_dequantized_model(k3_mxfp4):
    """Training around frozen mxfp4 experts (LoRA elsewhere, the latent projections, ...): every other parameter's
    gradient equals the dequantized model's whose experts are frozen too."""
    folder, _ = k3_mxfp4
    packed, dense = load(folder, "mxfp4"), load(folder, "dense")
    for experts in sparse_experts(dense):
        experts.requires_grad_(False)
    inputs = model_inputs()
    grads = []
    for model in (packed, dense):
        model.train()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and any("latent_down_proj" in name for name in grads[0])
    # The packed model's CPU path loops over the experts, the dense one runs transformers' grouped GEMMs: fp32 sums in
    # other orders, whose differences multi-threaded GEMMs carry back through every layer (up to 9e-6 of a gradient's
    # norm measured with 2 threads, 0 with 1).
    for name, grad in grads[0].items():
        assert ((grad - grads[1][name]).norm() / grads[1][name].norm()).item() < 1e-4, name


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_grouped_kernel_on_packed_experts_matches_the_pytorch_path(k3_mxfp4):
    folder, _ = k3_mxfp4
    device = "cpu" if INTERPRETED else "cuda"
    triton_model, torch_model = load(folder, "mxfp4", "triton").to(device), load(folder, "mxfp4", "torch").to(device)
    inputs = {name: tensor.to(device) for name, tensor in model_inputs().items()}
    with torch.no_grad():
        torch.testing.assert_close(triton_model(**inputs).logits, torch_model(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_packed_experts_write_the_k3_layout_byte_for_byte_and_reload_from_ours(k3_mxfp4, tmp_path):
    folder, written = k3_mxfp4
    packed = load(folder, "mxfp4")
    packed.save_pretrained(tmp_path / "k3")
    saved = {}
    for file in (tmp_path / "k3").glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            saved.update({name: handle.get_tensor(name) for name in handle.keys()})
    expert_names = [name for name in written if ".experts." in name and "shared" not in name]
    assert expert_names and all(name.endswith(("_packed", "_scale")) for name in expert_names)
    for name in expert_names:
        assert saved[name].dtype == torch.uint8 and torch.equal(saved[name], written[name]), name
    config = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"

    packed.save_pretrained(tmp_path / "ours", layout="kda_moe")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "ours")
    assert reloaded.config.text_config.routed_expert_format == "mxfp4"
    for name, tensor in packed.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_mxfp4_experts_need_input_widths_in_whole_scale_groups():
    with pytest.raises(ConfigValidationError, match="multiples of 32; moe_intermediate_size"):
        KdaMoeTextConfig(routed_expert_format="mxfp4", moe_intermediate_size=48, routed_expert_hidden_size=64)
    with pytest.raises(ConfigValidationError, match="routed_expert_hidden_size"):
        KdaMoeTextConfig(routed_expert_format="mxfp4", moe_intermediate_size=64, routed_expert_hidden_size=48)


class Identity(torch.nn.Module):
    def forward(self, weight):
        return weight


@pytest.mark.parametrize("setup,refusal", [("expert_parallel_shard", "run whole"), ("adapter", "take no adapter")])
def test_packed_experts_refuse_an_expert_parallel_shard_and_an_adapter(k3_mxfp4, setup, refusal):
    folder, _ = k3_mxfp4
    experts = sparse_experts(load(folder, "mxfp4"))[0]
    if setup == "adapter":  # how PEFT's expert LoRA wraps the weights
        torch.nn.utils.parametrize.register_parametrization(experts, "gate_up_proj", Identity(), unsafe=True)
    else:
        experts._is_expert_parallel = True  # what transformers' expert-parallel plan marks a shard with
    hidden = torch.randn(3, experts.hidden_dim)
    index, weights = torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match=f"{refusal}.*routed_expert_format='dense'"):
        experts(hidden, index, weights)


def test_packed_experts_stay_bytes_under_a_dtype_cast_and_refuse_the_kimi_linear_layout(k3_mxfp4, tmp_path):
    folder, _ = k3_mxfp4
    packed = load(folder, "mxfp4").to(torch.bfloat16)
    assert all(experts.gate_up_proj.dtype == torch.uint8 for experts in sparse_experts(packed))
    with torch.no_grad():
        assert torch.isfinite(packed(**model_inputs()).logits).all()
    with pytest.raises(ValueError, match="kimi_linear layout cannot store"):
        packed.save_pretrained(tmp_path / "kl", layout="kimi_linear")


def test_packed_model_generates_the_dequantized_models_greedy_tokens(k3_mxfp4):
    folder, _ = k3_mxfp4
    packed, dense = load(folder, "mxfp4"), load(folder, "dense")
    inputs = model_inputs()
    greedy = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(packed.generate(**inputs, **greedy), dense.generate(**inputs, **greedy))


@pytest.mark.parametrize("expert_format", ["dense", "mxfp4"])
def test_k3_folder_offloaded_to_disk_generates_the_loaded_models_tokens(k3_mxfp4, tmp_path, expert_format):
    """The K3 folder with mxfp4 experts under `device_map="auto"` and a memory limit that sends the last decoder
    layers to disk: experts decoded on load, or kept packed (uint8 parameters offloaded and onloaded as they are),
    generate the greedy tokens of the same model loaded whole."""
    from accelerate.utils import compute_module_sizes

    folder, _ = k3_mxfp4
    whole = load(folder, expert_format)
    sizes = compute_module_sizes(whole)
    text = "model.language_model"
    budget = sizes["lm_head"] + sizes["model.vision_tower"] + sizes["model.multi_modal_projector"]
    budget += sizes[f"{text}.embed_tokens"] + sizes[f"{text}.layers.0"] + sizes[f"{text}.layers.1"]
    config = AutoConfig.from_pretrained(folder)
    config.text_config.routed_expert_format = expert_format
    offloaded = AutoModelForImageTextToText.from_pretrained(
        folder, config=config, device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    ).eval()
    layers = {name: device for name, device in offloaded.hf_device_map.items() if name.startswith(f"{text}.layers.")}
    assert {"cpu", "disk"} <= set(layers.values()), offloaded.hf_device_map
    offloaded_experts = sorted((tmp_path / "offload").glob("*.mlp.experts.gate_up_proj.safetensors"))
    assert offloaded_experts  # some sparse layer's experts lie on disk, written in the loaded parameters' dtype
    for path in offloaded_experts:
        with safe_open(path, "pt") as f:
            stored = f.get_tensor(f.keys()[0])
        assert stored.dtype == (torch.uint8 if expert_format == "mxfp4" else torch.float32), path.name
    inputs = model_inputs()
    greedy = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(**inputs).logits, whole(**inputs).logits, rtol=1e-5, atol=1e-6)
        assert torch.equal(offloaded.generate(**inputs, **greedy), whole.generate(**inputs, **greedy))
