"""Kimi Linear checkpoints load into KdaMoeForCausalLM and compute what transformers' KimiLinearForCausalLM computes.

Three folders from one random tiny transformers model (CPU, fp32): the layout `KimiLinearForCausalLM.save_pretrained`
writes by default, transformers' in-memory layout (`save_original_format=False`), and the published remote-code
layout of `moonshotai/Kimi-Linear-48B-A3B` with its `config.json` style, built here by hand from the same weights.
"""

import importlib
import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kda_moe import KdaMoeForCausalLM

KIMI_LINEAR_MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
MLP_LAYER_TYPES = ["dense", "sparse", "sparse", "sparse"]
NUM_EXPERTS = 8


def import_kimi_linear_on_torch():
    """transformers' Kimi Linear modeling module, bound to its PyTorch reference functions.

    It binds fla's kernels at import whenever fla is importable, and those fail on CPU tensors ("0 active drivers").
    Other tests of this session import `fla.ops.kda.*`, so every `fla` entry of `sys.modules` is hidden while a
    fresh copy of the module is imported, then `sys.modules` is put back as it was (fla and any earlier copy).
    """
    fla_modules = {name: module for name, module in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    earlier_copy = sys.modules.pop(KIMI_LINEAR_MODELING, None)
    for name in fla_modules:
        del sys.modules[name]
    sys.modules["fla"] = None  # `import fla` now raises ImportError
    try:
        return importlib.import_module(KIMI_LINEAR_MODELING)
    finally:
        del sys.modules["fla"]
        sys.modules.update(fla_modules)
        sys.modules.pop(KIMI_LINEAR_MODELING, None)
        if earlier_copy is not None:
            sys.modules[KIMI_LINEAR_MODELING] = earlier_copy


def tiny_kimi_linear_config():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        mlp_layer_types=MLP_LAYER_TYPES,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def reference():
    """A random tiny KimiLinearForCausalLM whose router biases, decay parameters and norm weights all matter."""
    modeling = import_kimi_linear_on_torch()
    torch.manual_seed(0)
    model = modeling.KimiLinearForCausalLM(tiny_kimi_linear_config()).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                tensor.add_(0.5 * noise)
            elif name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * noise)
    model.generation_config.eos_token_id = None  # random weights: let every generation run its full length
    return model


def published_layout(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory Kimi Linear names -> the remote-code names of the published checkpoints."""
    published = {}
    for name, tensor in state_dict.items():
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        if name.startswith("model.layers.") and MLP_LAYER_TYPES[int(name.split(".")[2])] == "sparse":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("self_attn.conv1d.weight"):
            for stream, weight in zip("qkv", tensor.chunk(3, dim=0)):
                published[name.replace("conv1d", f"{stream}_conv1d")] = weight
        elif name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for j in range(tensor.shape[0]):
                published[name.replace("gate_up_proj", f"{j}.w1.weight")] = gate[j]
                published[name.replace("gate_up_proj", f"{j}.w3.weight")] = up[j]
        elif name.endswith("experts.down_proj"):
            for j in range(tensor.shape[0]):
                published[name.replace("down_proj", f"{j}.w2.weight")] = tensor[j]
        else:
            published[name] = tensor
    return {name: tensor.detach().clone().contiguous() for name, tensor in published.items()}


def published_config(config) -> dict:
    """`config.json` in the style of moonshotai/Kimi-Linear-48B-A3B (1-based layer lists, remote-code key names)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_kimi.KimiLinearConfig",
            "AutoModel": "modeling_kimi.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
        },
        "model_type": "kimi_linear",
        "dtype": "float32",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": 0.02,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
            "num_heads": config.linear_num_heads,
            "head_dim": config.linear_head_dim,
            "short_conv_kernel_size": config.linear_conv_kernel_dim,
        },
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "head_dim": config.qk_rope_head_dim,
        "q_lora_rank": None,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "first_k_dense_replace": MLP_LAYER_TYPES.index("sparse"),
        "moe_layer_freq": 1,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": 1,
        "moe_intermediate_size": config.moe_intermediate_size,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": config.routed_scaling_factor,
        "num_expert_group": 1,
        "topk_group": 1,
        "use_grouped_topk": True,
        "num_nextn_predict_layers": 0,
        "transformers_version": "4.57.0",
    }


@pytest.fixture(scope="module")
def checkpoint_folders(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_linear")
    reference.save_pretrained(root / "transformers_default")
    reference.save_pretrained(root / "transformers_in_memory", save_original_format=False)
    published = root / "published"
    published.mkdir()
    save_file(published_layout(reference.state_dict()), published / "model.safetensors", metadata={"format": "pt"})
    (published / "config.json").write_text(json.dumps(published_config(reference.config), indent=2))
    folders = (root / "transformers_default", root / "transformers_in_memory", published)
    return {folder.name: folder for folder in folders}


def safetensors_keys(folder) -> set[str]:
    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            keys |= set(handle.keys())
    return keys


def load_ours(folder):
    model, loading_info = KdaMoeForCausalLM.from_pretrained(folder, output_loading_info=True)
    problems = {kind: entries for kind, entries in loading_info.items() if entries}
    assert not problems, problems  # missing, unexpected, mismatched keys, conversion errors
    model.generation_config.eos_token_id = None
    return model.eval()


def test_checkpoint_layouts_are_the_ones_under_test(checkpoint_folders):
    default, in_memory, published = (safetensors_keys(folder) for folder in checkpoint_folders.values())
    kda, dense, moe = "model.layers.0.self_attn.", "model.layers.0.", "model.layers.1."
    assert {kda + "q_conv1d.weight", kda + "A_log", moe + "block_sparse_moe.experts.7.w2.weight"} <= default
    assert {kda + "forget_gate.A_log", kda + "conv1d.weight", moe + "mlp.experts.gate_up_proj"} <= in_memory
    assert {kda + "q_conv1d.weight", kda + "f_a_proj.weight", dense + "mlp.gate_proj.weight"} <= published
    assert {moe + "block_sparse_moe.experts.0.w1.weight", moe + "block_sparse_moe.gate.weight"} <= published
    with safe_open(checkpoint_folders["published"] / "model.safetensors", "pt") as handle:
        assert handle.get_slice(kda + "A_log").get_shape() == [1, 1, 2, 1]


@pytest.mark.parametrize("layout", ["transformers_default", "transformers_in_memory", "published"])
def test_kimi_linear_checkpoint_gives_the_logits_of_transformers_model(reference, checkpoint_folders, layout):
    ours = load_ours(checkpoint_folders[layout])
    assert ours.config.model_type == "kda_moe_text"
    assert ours.config.layer_types == LAYER_TYPES and ours.config.mlp_layer_types == MLP_LAYER_TYPES
    input_ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(2))  # crosses a 64-token chunk
    with torch.no_grad():
        expected, actual = reference(input_ids).logits, ours(input_ids).logits
    assert expected.std() > 0.5  # the weights are large enough for a layout mistake to show
    assert (actual - expected).abs().max() < 1e-4


def test_kimi_linear_checkpoint_gives_the_greedy_generations_of_transformers_model(reference, checkpoint_folders):
    ours = load_ours(checkpoint_folders["transformers_default"])
    prompt = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected, actual = reference.generate(prompt, **settings), ours.generate(prompt, **settings)
    assert expected.shape[1] == 7 + 20
    assert torch.equal(actual, expected)


def safetensors_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


@pytest.mark.parametrize("layout", ["transformers_default", "transformers_in_memory", "published"])
def test_saving_a_converted_checkpoint_writes_its_layout_back(checkpoint_folders, layout, tmp_path):
    """transformers undoes on save the conversions a model was loaded with: the same names, shapes and values."""
    load_ours(checkpoint_folders[layout]).save_pretrained(tmp_path / "resaved")
    original, resaved = safetensors_tensors(checkpoint_folders[layout]), safetensors_tensors(tmp_path / "resaved")
    assert resaved.keys() == original.keys()
    for name, tensor in original.items():
        assert resaved[name].shape == tensor.shape and torch.equal(resaved[name], tensor), name


@pytest.mark.parametrize("layout", ["transformers_default", "transformers_in_memory"])
def test_transformers_model_loads_a_resaved_checkpoint_with_the_same_logits(
    reference, checkpoint_folders, layout, tmp_path
):
    load_ours(checkpoint_folders[layout]).save_pretrained(tmp_path / "resaved")
    modeling = import_kimi_linear_on_torch()
    reloaded, loading_info = modeling.KimiLinearForCausalLM.from_pretrained(
        tmp_path / "resaved", config=reference.config, output_loading_info=True
    )
    assert not any(loading_info.values()), loading_info
    input_ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(input_ids).logits, reference(input_ids).logits)


def test_our_layout_is_saved_for_our_checkpoints_new_models_and_without_original_format(checkpoint_folders, tmp_path):
    ours = load_ours(checkpoint_folders["published"])
    ours.save_pretrained(tmp_path / "ours", save_original_format=False)
    assert safetensors_keys(tmp_path / "ours") == set(ours.state_dict())
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "kda_moe_text"
    reloaded = load_ours(tmp_path / "ours")  # goes through the `A_log` conversion only, by name
    reloaded.save_pretrained(tmp_path / "ours_again")
    again = safetensors_tensors(tmp_path / "ours_again")
    assert again.keys() == set(ours.state_dict())
    for name, tensor in ours.state_dict().items():
        assert again[name].shape == tensor.shape and torch.equal(again[name], tensor), name

    # A model built in memory has no loading to undo.
    KdaMoeForCausalLM(ours.config).save_pretrained(tmp_path / "new")
    assert safetensors_keys(tmp_path / "new") == set(ours.state_dict())
