"""The published Kimi K3 checkpoint layout: loading it, its mxfp4 routed experts, writing it (and Kimi Linear's) back.

The K3 folders here are written by a writer of this file, from the tensor names third-party readers of the released
index see (`language_model.model.*`, `vision_tower.*`, `mm_projector.*`, per-expert `w1/w2/w3`, `A_log` zero-padded
to 128 heads, ...), not by the package's own save path, so a wrong mapping in the package cannot hide itself.
"""

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

import kda_moe  # noqa: F401  (registers the classes and the `kimi_k3` model type)
from kda_moe import KdaMoeForConditionalGeneration

IMAGE_TOKEN = 100
PATCH_DIM = 3 * 14 * 14

# A tiny config in the published K3 spelling: the text part in Kimi Linear's keys, the vision part in MoonViT's.
K3_CONFIG = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "media_placeholder_token_id": IMAGE_TOKEN,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "kimi_linear",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_attention_heads": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "first_k_dense_replace": 1,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "hidden_act": "situ",
        "attn_res_block_size": 2,
        "router_balancing": "quantile",
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "vt_hidden_size": 32,
        "vt_intermediate_size": 64,
        "vt_num_hidden_layers": 2,
        "vt_num_attention_heads": 2,
        "patch_size": 14,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "init_pos_emb_time": 4,
        "merge_kernel_size": [2, 2],
        "mm_hidden_size": 32,
        "text_hidden_size": 64,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
    },
}


# ----- the test-side writer: our model -> the published K3 names

# Our name -> K3 name, applied in order (a name is renamed by every pattern that matches it).
K3_NAMES = [
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"\.attn_res\.(norm|proj)\.", r".self_attention_res_\1."),
    (r"\.mlp_res\.(norm|proj)\.", r".mlp_res_\1."),
    (r"\.out_res\.(norm|proj)\.", r".output_attn_res_\1."),
    (r"\.mlp\.latent_(down_proj|up_proj|norm)\.", r".block_sparse_moe.routed_expert_\1."),
    (r"\.mlp\.(gate|shared_experts|experts)\.", r".block_sparse_moe.\1."),
    (r"^model\.vision_tower\.blocks\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"^model\.vision_tower\.blocks\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"^model\.vision_tower\.blocks\.(\d+)\.attn\.o_proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"^model\.vision_tower\.blocks\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"^model\.vision_tower\.blocks\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.post_norm\.", "vision_tower.encoder.final_layernorm."),
    (r"^model\.vision_tower\.pos_emb\.", "vision_tower.patch_embed.pos_emb."),
    (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.multi_modal_projector\.linear_1\.", "mm_projector.proj.0."),
    (r"^model\.multi_modal_projector\.linear_2\.", "mm_projector.proj.2."),
    (r"^model\.multi_modal_projector\.norm\.", "mm_projector.post_norm."),
]


def moonvit_index(head_dim: int) -> torch.Tensor:
    """For each row j of one of our q/k heads, the MoonViT row it comes from. MoonViT rotates complex pairs,
    (4i, 4i+1) by the column angle of frequency i and (4i+2, 4i+3) by the row angle; ours rotates the first half by
    the row, the second by the column, each half as [real parts | imaginary parts]."""
    index = []
    for j in range(head_dim):
        half, within = divmod(j, head_dim // 2)  # half 0: row, 1: column
        part, frequency = divmod(within, head_dim // 4)  # part 0: real, 1: imaginary
        axis = 1 - half  # MoonViT: 0 = column, 1 = row
        index.append(4 * frequency + 2 * axis + part)
    return torch.tensor(index)


def to_moonvit_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    head_dim = weight.shape[0] // heads
    moonvit = torch.empty_like(weight).view(heads, head_dim, -1)
    moonvit[:, moonvit_index(head_dim)] = weight.view(heads, head_dim, -1)
    return moonvit.reshape(weight.shape)


def k3_state_dict(model: KdaMoeForConditionalGeneration) -> dict[str, torch.Tensor]:
    """`model`'s weights under the published K3 names and shapes (unquantized)."""
    config = model.config
    heads = config.vision_config.num_attention_heads
    state, qkv = {}, {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone()
        if match := re.match(r"model\.vision_tower\.blocks\.(\d+)\.attn\.([qkv])_proj\.weight", name):
            qkv.setdefault(match[1], {})[match[2]] = tensor
            continue
        for pattern, replacement in K3_NAMES:
            name = re.sub(pattern, replacement, name)
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for j in range(tensor.shape[0]):
                state[name.replace("gate_up_proj", f"{j}.w1.weight")] = gate[j].contiguous()
                state[name.replace("gate_up_proj", f"{j}.w3.weight")] = up[j].contiguous()
        elif name.endswith("experts.down_proj"):
            for j in range(tensor.shape[0]):
                state[name.replace("down_proj", f"{j}.w2.weight")] = tensor[j].contiguous()
        elif name.endswith("self_attn.conv1d.weight"):
            for stream, part in zip("qkv", tensor.chunk(3)):
                state[name.replace("conv1d", f"{stream}_conv1d")] = part.contiguous()
        elif name.endswith("self_attn.A_log"):
            state[name] = torch.cat([tensor.float(), tensor.new_zeros(128 - tensor.numel())])
        elif name == "vision_tower.patch_embed.proj.weight":
            state[name] = tensor.view(tensor.shape[0], 3, 14, 14)
        else:
            state[name] = tensor
    for block, parts in qkv.items():
        q, k, v = (parts[stream] for stream in "qkv")
        state[f"vision_tower.encoder.blocks.{block}.wqkv.weight"] = torch.cat(
            [to_moonvit_rows(q, heads), to_moonvit_rows(k, heads), v]
        )
    # the release also stores an (unused) AttnRes pseudo-query for layer 0
    hidden = config.text_config.hidden_size
    state["language_model.model.layers.0.self_attention_res_norm.weight"] = torch.ones(hidden)
    state["language_model.model.layers.0.self_attention_res_proj.weight"] = torch.zeros(1, hidden)
    return state


def write_k3_folder(folder, state: dict[str, torch.Tensor], config: dict = K3_CONFIG, shards: int = 2):
    """A sharded safetensors folder with an index, as the release ships it."""
    names = sorted(state)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name].contiguous() for name in names[shard::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))


def randomize_parameters(model: torch.nn.Module) -> None:
    """Every parameter random (AttnRes pseudo-queries and biases start at zero otherwise): A_log in [0, 2], other
    vectors (norm weights, dt_bias) in [0.5, 1.5], matrices N(0, 0.1)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.uniform_(0.0, 2.0)
            elif parameter.ndim == 1:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)


def randomized_model(config) -> KdaMoeForConditionalGeneration:
    """A model whose every weight is random, the routers' balancing biases (buffers) included."""
    torch.manual_seed(0)
    model = KdaMoeForConditionalGeneration(config).eval()
    randomize_parameters(model)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if getattr(layer.mlp, "gate", None) is not None:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.01)
    return model


def model_inputs():
    torch.manual_seed(1)
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 merged patches
    input_ids = torch.tensor([[5, 6] + [IMAGE_TOKEN] * 4 + [7, 8, 9, 10]])
    return {"input_ids": input_ids, "pixel_values": torch.randn(16, PATCH_DIM), "image_grid_thw": grid}


@pytest.fixture
def k3_model(tmp_path):
    """(model, K3 folder): a random model built from the K3 `config.json` and written in the K3 layout."""
    source = tmp_path / "config_only"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(K3_CONFIG))
    model = randomized_model(AutoConfig.from_pretrained(source))
    folder = tmp_path / "k3"
    folder.mkdir()
    write_k3_folder(folder, k3_state_dict(model))
    return model, folder


def test_k3_config_maps_to_the_multimodal_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(K3_CONFIG))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, kda_moe.KdaMoeConfig)
    assert config.image_token_id == IMAGE_TOKEN
    text, vision = config.text_config, config.vision_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert text.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (text.linear_num_heads, text.linear_head_dim, text.num_experts_per_tok) == (2, 16, 2)
    assert (text.routed_expert_hidden_size, text.attn_res_block_size, text.hidden_act) == (32, 2, "situ")
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (32, 2, 2)
    assert (vision.pos_emb_height, vision.spatial_merge_size) == (8, 2)
    assert config.projector_rms_norm_eps == 1e-5 and config.projector_hidden_size == 4 * 32


def test_k3_config_with_a_projector_width_of_another_text_model_is_refused(tmp_path):
    config = json.loads(json.dumps(K3_CONFIG))
    config["vision_config"]["text_hidden_size"] = 7168
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="text_hidden_size"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("auto_class", [AutoModelForImageTextToText, AutoModelForCausalLM])
def test_k3_layout_loads_without_missing_keys_and_gives_the_same_logits(k3_model, auto_class):
    model, folder = k3_model
    loaded, info = auto_class.from_pretrained(folder, output_loading_info=True)
    assert isinstance(loaded, KdaMoeForConditionalGeneration)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    inputs = model_inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_moonvit_rotary_layout_is_converted_to_ours():
    """MoonViT's 2D RoPE (complex pairs; pair 2i rotated by the column angle, 2i+1 by the row angle) applied to a
    head equals ours applied to the head in our row order, up to that same row order: attention scores agree."""
    from kda_moe.configuration import KdaMoeVisionConfig
    from kda_moe.modeling.conversion import moonvit_rope_permutation
    from kda_moe.modeling.modeling_kda_moe_vision import KdaMoeVisionRotaryEmbedding, apply_2d_rotary_pos_emb

    config = KdaMoeVisionConfig(hidden_size=32, num_attention_heads=2)  # head_dim 16
    head_dim, grid = config.head_dim, (3, 5)
    assert torch.equal(moonvit_rope_permutation(head_dim), moonvit_index(head_dim))

    rows = torch.arange(grid[0]).repeat_interleave(grid[1]).float()
    cols = torch.arange(grid[1]).repeat(grid[0]).float()
    frequencies = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 4).float() / head_dim)
    angles = torch.stack([cols[:, None] * frequencies, rows[:, None] * frequencies], dim=-1).flatten(1)  # x0, y0, ..
    head = torch.randn(grid[0] * grid[1], head_dim)
    moonvit = torch.view_as_real(torch.view_as_complex(head.view(-1, head_dim // 2, 2)) * torch.polar(
        torch.ones_like(angles), angles
    )).flatten(1)  # fmt: skip

    cos, sin = KdaMoeVisionRotaryEmbedding(config)([grid], torch.device("cpu"))
    ours = apply_2d_rotary_pos_emb(head[:, moonvit_index(head_dim)][None, None], cos, sin)[0, 0]
    torch.testing.assert_close(ours, moonvit[:, moonvit_index(head_dim)])


# ----- mxfp4 routed experts, packed by compressed-tensors itself


def mxfp4_scheme():
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("MXFP4A16", [r"re:.*block_sparse_moe\.experts\..*"])
    scheme.format = "mxfp4-pack-quantized"
    return scheme


def mxfp4_quantization_config() -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": mxfp4_scheme()}, format="mxfp4-pack-quantized", quantization_status="compressed"
    )
    return config.model_dump(mode="json")


def pack_experts_mxfp4(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(K3 state dict with every `experts.j.w*.weight` packed by compressed-tensors' quantizer, {name: its group
    scale per weight}) ."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = mxfp4_scheme()
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    packed, scales = {}, {}
    for name, tensor in state.items():
        if not re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            packed[name] = tensor
            continue
        groups = tensor.view(tensor.shape[0], -1, 32)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        compressed = compressor.compress({"weight": tensor, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        packed[name + "_packed"] = compressed["weight_packed"]
        packed[name + "_scale"] = compressed["weight_scale"]
        scales[name] = scale.repeat_interleave(32, dim=-1)
    return packed, scales


def dequantized_reference(model, packed_state) -> KdaMoeForConditionalGeneration:
    """A copy of `model` whose routed experts are compressed-tensors' own decoding of the packed weights."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    reference = randomized_model(model.config)
    reference.load_state_dict(model.state_dict())

    def decoded(name):
        weights = {"weight_packed": packed_state[name + "_packed"], "weight_scale": packed_state[name + "_scale"]}
        return compressor.decompress(weights, mxfp4_scheme())["weight"].float()

    with torch.no_grad():
        for index, layer in enumerate(reference.model.language_model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            prefix = f"language_model.model.layers.{index}.block_sparse_moe.experts"
            for j in range(experts.gate_up_proj.shape[0]):
                w1, w2, w3 = (decoded(f"{prefix}.{j}.{w}.weight") for w in ("w1", "w2", "w3"))
                experts.gate_up_proj[j] = torch.cat([w1, w3])
                experts.down_proj[j] = w2
    return reference


def test_mxfp4_experts_load_within_mxfp4_rounding_and_match_the_dequantized_model(k3_model, tmp_path):
    pytest.importorskip("compressed_tensors")
    model, _ = k3_model
    state = k3_state_dict(model)
    packed_state, group_scales = pack_experts_mxfp4(state)
    folder = tmp_path / "k3_mxfp4"
    folder.mkdir()
    write_k3_folder(folder, packed_state, {**K3_CONFIG, "quantization_config": mxfp4_quantization_config()})

    loaded, info = AutoModelForImageTextToText.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    # Bound, element by element: MXFP4 scales each group of 32 by s = 2**(floor(log2(max|w|)) - 2) (max|w| rounded
    # to a power of two first), so |w| / s < 8. E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6: spacing <= 2 below 6, so
    # rounding moves a weight by <= s, and clipping (6, 8) to 6 by < 2s. Decoded values (E2M1 times a power of two)
    # are exact in bf16 and fp32.
    loaded_state = loaded.state_dict()
    for index, layer in enumerate(model.model.language_model.layers):
        if getattr(layer.mlp, "experts", None) is None:
            continue
        prefix = f"language_model.model.layers.{index}.block_sparse_moe.experts"
        ours = f"model.language_model.layers.{index}.mlp.experts"
        for j in range(layer.mlp.experts.gate_up_proj.shape[0]):
            gate_up, down = loaded_state[f"{ours}.gate_up_proj"][j], loaded_state[f"{ours}.down_proj"][j]
            for w, value in (("w1", gate_up.chunk(2)[0]), ("w3", gate_up.chunk(2)[1]), ("w2", down)):
                name = f"{prefix}.{j}.{w}.weight"
                error = (value - state[name]).abs()
                assert (error <= 2 * group_scales[name]).all(), name
            assert gate_up.dtype == torch.float32  # the model's dtype, as the dense checkpoint gives
            assert not torch.equal(gate_up, model.state_dict()[f"{ours}.gate_up_proj"][j])  # really quantized

    reference = dequantized_reference(model, packed_state)
    inputs = model_inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**inputs).logits, reference.eval()(**inputs).logits, rtol=0, atol=0)


def test_k3_layout_saves_back_to_the_same_tensors(k3_model, tmp_path):
    """K3 layout -> ours -> K3 layout is bit-exact (the unused layer-0 AttnRes pair is not kept)."""
    from safetensors.torch import load_file

    model, folder = k3_model
    written = k3_state_dict(model)
    AutoModelForImageTextToText.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    saved = {}
    for file in (tmp_path / "saved").glob("*.safetensors"):
        saved.update(load_file(str(file)))
    unused = {f"language_model.model.layers.0.self_attention_res_{part}.weight" for part in ("norm", "proj")}
    assert set(saved) == set(written) - unused
    for name, tensor in saved.items():
        assert tensor.dtype == written[name].dtype and torch.equal(tensor, written[name]), name


def test_mxfp4_experts_save_back_dequantized_under_the_dense_names(k3_model, tmp_path):
    pytest.importorskip("compressed_tensors")
    model, _ = k3_model
    packed_state, _ = pack_experts_mxfp4(k3_state_dict(model))
    folder = tmp_path / "k3_mxfp4"
    folder.mkdir()
    write_k3_folder(folder, packed_state, {**K3_CONFIG, "quantization_config": mxfp4_quantization_config()})
    loaded = AutoModelForImageTextToText.from_pretrained(folder)
    loaded.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    names = set()
    for file in (tmp_path / "saved").glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            names.update(handle.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert not any("weight_packed" in name or "weight_scale" in name for name in names)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
