"""`save_pretrained(..., layout=...)` writes the published Kimi Linear and Kimi K3 layouts, mxfp4 experts included.

Each written folder is read by a reader that is not the package's save path: transformers' own
`KimiLinearForCausalLM` for Kimi Linear, and for K3 the test-side writer of `test_k3_layout.py` (what the folder must
hold) plus compressed-tensors' own packing and decoding of the experts.
"""

import json

import pytest
import torch
from safetensors import safe_open
from test_k3_layout import (
    K3_CONFIG,
    dequantized_reference,
    k3_state_dict,
    model_inputs,
    mxfp4_quantization_config,
    pack_experts_mxfp4,
    randomize_parameters,
    randomized_model,
    write_k3_folder,
)
from test_kimi_linear_checkpoints import import_kimi_linear_on_torch
from transformers import AutoModelForImageTextToText

from kda_moe import KdaMoeConfig, KdaMoeForCausalLM
from kda_moe.configuration import KdaMoeTextConfig
from kda_moe.configuration.configuration_kda_moe import KIMI_LINEAR_DEFAULTS

# the layer-0 AttnRes pair the release stores is unused, and the model does not keep it
UNUSED_K3_KEYS = {f"language_model.model.layers.0.self_attention_res_{part}.weight" for part in ("norm", "proj")}


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def config_json(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def kimi_linear_model() -> KdaMoeForCausalLM:
    """A random tiny text model with Kimi Linear's features only (no AttnRes, latent MoE, bounded gate, ...)."""
    config = KdaMoeTextConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_num_heads=2,
        linear_head_dim=16,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        routed_scaling_factor=2.446,
        **KIMI_LINEAR_DEFAULTS,
    )
    torch.manual_seed(0)
    model = KdaMoeForCausalLM(config).eval()
    randomize_parameters(model)
    return model


def k3_model() -> torch.nn.Module:
    return randomized_model(KdaMoeConfig(**KdaMoeConfig._from_kimi_linear_keys(K3_CONFIG)))


# ----- Kimi Linear


def test_kimi_linear_layout_loads_in_transformers_kimi_linear_with_our_logits(tmp_path):
    model = kimi_linear_model()
    model.save_pretrained(tmp_path, layout="kimi_linear")
    written = config_json(tmp_path)
    assert written["model_type"] == "kimi_linear" and "auto_map" not in written
    assert written["linear_attn_config"]["full_attn_layers"] == [3]
    names = set(folder_tensors(tmp_path))
    assert {"model.layers.0.self_attn.q_conv1d.weight", "model.layers.1.block_sparse_moe.experts.7.w2.weight"} <= names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense MLP where the published remote code reads it

    modeling = import_kimi_linear_on_torch()
    theirs, info = modeling.KimiLinearForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert theirs.config.layer_types == model.config.layer_types
    assert theirs.config.mlp_layer_types == model.config.mlp_layer_types
    input_ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(2))  # crosses a 64-token chunk
    with torch.no_grad():
        expected, actual = model(input_ids).logits, theirs.eval()(input_ids).logits
    assert expected.std() > 0.5  # large enough for a layout mistake to show
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)  # fp32; the two chunk the scan differently


def test_a_model_loaded_from_a_published_layout_saves_it_back_by_default(tmp_path):
    kimi_linear_model().save_pretrained(tmp_path / "kimi_linear", layout="kimi_linear")
    loaded = KdaMoeForCausalLM.from_pretrained(tmp_path / "kimi_linear")
    loaded.save_pretrained(tmp_path / "default")
    assert config_json(tmp_path / "default")["model_type"] == "kimi_linear"
    assert config_json(tmp_path / "default") == config_json(tmp_path / "kimi_linear")
    original, resaved = folder_tensors(tmp_path / "kimi_linear"), folder_tensors(tmp_path / "default")
    assert resaved.keys() == original.keys()
    assert all(torch.equal(resaved[name], tensor) for name, tensor in original.items())
    assert loaded._weight_conversions  # saving leaves the conversions the model was loaded with in place

    loaded.save_pretrained(tmp_path / "ours", layout="kda_moe")
    assert config_json(tmp_path / "ours")["model_type"] == "kda_moe_text"
    assert set(folder_tensors(tmp_path / "ours")) == set(loaded.state_dict())


# ----- Kimi K3


def test_k3_layout_writes_the_published_names_and_config_and_reads_back_identically(tmp_path):
    model = k3_model()
    model.save_pretrained(tmp_path, layout="kimi_k3", max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded, with an index, as the release

    expected = k3_state_dict(model)  # the test-side writer
    written = folder_tensors(tmp_path)
    assert written.keys() == expected.keys() - UNUSED_K3_KEYS
    for name, tensor in written.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name

    config = config_json(tmp_path)
    assert config["model_type"] == "kimi_k3" and "quantization_config" not in config
    assert config["media_placeholder_token_id"] == K3_CONFIG["media_placeholder_token_id"]
    for key in ("text_config", "vision_config"):
        published = K3_CONFIG[key]
        assert {k: config[key][k] for k in published if k in config[key]} == {
            k: v for k, v in published.items() if k in config[key]
        }
    assert set(K3_CONFIG["text_config"]) <= set(config["text_config"])
    assert set(K3_CONFIG["vision_config"]) - {"init_pos_emb_time"} <= set(config["vision_config"])  # video: not read

    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    recorded = ("dtype", "architectures", "transformers_version")  # what saving records about the run
    for sub in ("text_config", "vision_config"):
        ours, theirs = getattr(model.config, sub).to_dict(), getattr(reloaded.config, sub).to_dict()
        assert {k: v for k, v in theirs.items() if k not in recorded} == {
            k: v for k, v in ours.items() if k not in recorded
        }, sub
    for field in ("image_token_id", "projector_hidden_size", "projector_hidden_act", "projector_rms_norm_eps"):
        assert getattr(reloaded.config, field) == getattr(model.config, field), field
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_k3_layout_with_mxfp4_experts_matches_compressed_tensors_packing(tmp_path):
    pytest.importorskip("compressed_tensors")
    model = k3_model()
    model.save_pretrained(tmp_path, layout="kimi_k3", quantize_experts="mxfp4")
    assert config_json(tmp_path)["quantization_config"] == mxfp4_quantization_config()

    packed, _ = pack_experts_mxfp4(k3_state_dict(model))  # compressed-tensors' own packing, test side
    written = folder_tensors(tmp_path)
    assert written.keys() == packed.keys() - UNUSED_K3_KEYS
    assert any(name.endswith("experts.3.w2.weight_packed") for name in written)
    for name, tensor in written.items():
        assert tensor.dtype == packed[name].dtype and torch.equal(tensor, packed[name]), name

    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    reference = dequantized_reference(model, packed)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    inputs = model_inputs()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**inputs).logits, reference.eval()(**inputs).logits, rtol=0, atol=0)


def test_mxfp4_k3_checkpoint_repacks_to_the_same_scales_and_values(tmp_path):
    """mxfp4 K3 -> ours -> mxfp4 K3: every tensor, scale and packed byte the same, but for the sign of a zero (a weight
    that rounded to -0 decodes to -0.0, which compressed-tensors packs as +0)."""
    pytest.importorskip("compressed_tensors")
    packed, _ = pack_experts_mxfp4(k3_state_dict(k3_model()))
    source = tmp_path / "source"
    source.mkdir()
    write_k3_folder(source, packed, {**K3_CONFIG, "quantization_config": mxfp4_quantization_config()})
    loaded = AutoModelForImageTextToText.from_pretrained(source)
    loaded.save_pretrained(tmp_path / "repacked", quantize_experts="mxfp4")  # layout: as loaded, K3
    assert config_json(tmp_path / "repacked")["quantization_config"] == mxfp4_quantization_config()
    written = folder_tensors(tmp_path / "repacked")
    assert written.keys() == packed.keys() - UNUSED_K3_KEYS
    for name, tensor in written.items():
        expected = packed[name]
        if name.endswith("weight_packed"):  # E2M1 nibbles: 0b1000 is -0
            tensor, expected = (torch.stack([t & 0xF, t >> 4]) for t in (tensor, expected))
            tensor, expected = (t.masked_fill(t == 0b1000, 0) for t in (tensor, expected))
        assert torch.equal(tensor, expected), name
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "repacked")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


# ----- what a layout cannot write


@pytest.mark.parametrize(
    "make_model, kwargs, message",
    [
        (kimi_linear_model, {"layout": "kimi_k2"}, "Unknown checkpoint layout 'kimi_k2'"),
        (kimi_linear_model, {"layout": "kimi_k3"}, "has no vision tower"),
        (kimi_linear_model, {"layout": "kimi_linear", "quantize_experts": "mxfp4"}, "pass layout='kimi_k3'"),
        (k3_model, {"layout": "kimi_k3", "quantize_experts": "int4"}, "Unknown expert quantization 'int4'"),
        (k3_model, {"layout": "kimi_linear"}, "vision tower"),
        (lambda: KdaMoeForCausalLM(KdaMoeTextConfig()), {"layout": "kimi_linear"}, "attn_res_block_size=2"),
        (lambda: KdaMoeForCausalLM(KdaMoeTextConfig()), {"layout": "kimi_linear"}, "routed_expert_hidden_size=128"),
        (lambda: KdaMoeForCausalLM(KdaMoeTextConfig()), {"layout": "kimi_linear"}, "hidden_act='situ'"),
    ],
)
def test_a_layout_that_cannot_express_the_model_is_refused_before_writing(tmp_path, make_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_model().save_pretrained(tmp_path / "folder", **kwargs)
    assert not (tmp_path / "folder").exists()


def test_kimi_linear_layout_refuses_dense_layers_after_sparse_ones(tmp_path):
    model = kimi_linear_model()
    model.config.mlp_layer_types = ["dense", "sparse", "dense", "sparse"]
    with pytest.raises(ValueError, match="mlp_layer_types"):
        model.save_pretrained(tmp_path, layout="kimi_linear")
