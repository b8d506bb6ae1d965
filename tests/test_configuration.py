"""KdaMoeTextConfig: defaults, validation, serialization, published Kimi layouts, the K3 shape."""

import logging

import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers import AutoModelForCausalLM, KimiLinearConfig

from kda_moe import KdaMoeConfig, KdaMoeForCausalLM, KdaMoeTextModel
from kda_moe.configuration import KdaMoeTextConfig

# ---------------------------------------------------------------- analytic parameter count


def k3_parameter_counts(c: KdaMoeTextConfig) -> tuple[int, int]:
    """(total, activated per token) parameters of the model `c` describes, from the architecture's formulas.

    Counting rule: parameters, not buffers (the router bias is a buffer). `activated` is everything except the
    routed experts a token does not select: all of attention, norms, AttnRes, router, latent down/up, shared
    experts, dense MLPs, plus the input embedding and the (untied) lm_head, each matrix counted once.
    """
    d, V = c.hidden_size, c.vocab_size
    H, K = c.linear_num_heads, c.linear_head_dim
    kda = (
        4 * d * H * K  # q, k, v, o projections
        + d * K + K * H * K  # decay f_a, f_b
        + d * H  # beta projection
        + (d * H * K if c.use_full_rank_gate else d * K + K * H * K)  # output gate
        + 3 * H * K * c.linear_conv_kernel_dim  # depthwise short convs on q, k, v
        + H * K + H  # dt_bias, A_log
        + K  # per-head output RMSNorm weight
    )  # fmt: skip
    h, nope, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = h * (nope + rope) * d if c.q_lora_rank is None else d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * (nope + rope)
    mla = (
        q
        + d * (c.kv_lora_rank + rope) + c.kv_lora_rank  # kv_a (+ shared rope key) and its norm
        + c.kv_lora_rank * h * (nope + v)  # kv_b
        + h * v * d  # o_proj
        + (d * h * v if c.mla_use_output_gate else 0)  # g_proj
    )  # fmt: skip
    E, k, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    l = c.routed_expert_hidden_size or d
    latent = 0 if c.routed_expert_hidden_size is None else 2 * d * l + (l if c.latent_moe_use_norm else 0)
    moe_common = E * d + latent + 3 * d * I * c.num_shared_experts  # router, latent down/up(+norm), shared
    dense = 3 * d * c.intermediate_size
    attn_res = 4 * d if c.attn_res_block_size is not None else 0  # attn/mlp pseudo-query proj + norm per layer

    common, routed_total, routed_active = 0, 0, 0
    for layer_type, mlp_type in zip(c.layer_types, c.mlp_layer_types):
        common += (kda if layer_type == "linear_attention" else mla) + 2 * d + attn_res
        if mlp_type == "dense":
            common += dense
        else:
            common += moe_common
            routed_total += E * 3 * I * l
            routed_active += k * 3 * I * l
    common += d + (2 * d if c.attn_res_block_size is not None else 0)  # final norm, output AttnRes mix
    common += V * d * (1 if c.tie_word_embeddings else 2)  # embeddings + lm_head
    return common + routed_total, common + routed_active


def test_kimi_k3_has_the_published_shape_and_parameter_count():
    c = KdaMoeTextConfig.kimi_k3()
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (7168, 93, 163840)
    assert c.layer_types.count("linear_attention") == 69 and c.layer_types.count("full_attention") == 24
    assert c.layer_types[-2:] == ["full_attention", "full_attention"]
    full = [i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"]
    assert full == [*range(4, 93, 4), 93]
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 92
    assert (c.linear_num_heads, c.linear_head_dim) == (96, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.num_shared_experts) == (896, 16, 2)
    assert (c.moe_intermediate_size, c.routed_expert_hidden_size, c.attn_res_block_size) == (3072, 3584, 12)
    assert (c.gate_lower_bound, c.use_full_rank_gate, c.mla_use_output_gate) == (-5.0, True, True)
    assert (c.hidden_act, c.router_balancing) == ("situ", "quantile")
    total, active = k3_parameter_counts(c)
    assert total == pytest.approx(2.78e12, rel=0.01)
    assert active == pytest.approx(104e9, rel=0.02)


def test_kimi_k3_overrides_win():
    c = KdaMoeTextConfig.kimi_k3(num_hidden_layers=8, num_experts=32)
    assert c.num_experts == 32 and len(c.layer_types) == 8 and c.layer_types[-1] == "full_attention"


def test_default_config_is_tiny_with_every_feature_on():
    c = KdaMoeTextConfig()
    assert c.model_type == "kda_moe_text"
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert c.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert c.qk_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim == 24
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert c.gate_lower_bound == -5.0 and c.use_full_rank_gate and c.mla_use_output_gate
    assert c.hidden_act == "situ" and c.router_balancing == "quantile" and c.attn_res_block_size == 2
    assert c.routed_expert_hidden_size == 128 and c.latent_moe_use_norm
    total, active = k3_parameter_counts(c)
    assert 0 < active < total < 5e6


def test_default_layer_types_follow_num_hidden_layers():
    c = KdaMoeTextConfig(num_hidden_layers=9)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [3, 7, 8]
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 8


# ---------------------------------------------------------------- serialization


def _comparable(config):
    d = config.to_dict()
    d.pop("transformers_version", None)
    return d


def test_to_dict_from_dict_round_trip():
    c = KdaMoeTextConfig(num_hidden_layers=5, gate_lower_bound=None, q_lora_rank=None, router_balancing="bias_sign")
    assert _comparable(KdaMoeTextConfig.from_dict(c.to_dict())) == _comparable(c)


def test_save_pretrained_from_pretrained_round_trip(tmp_path):
    c = KdaMoeTextConfig(
        mla_use_nope=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
        activation_situ_linear_beta=None,
        attn_res_block_size=None,
    )
    c.save_pretrained(tmp_path)
    loaded = KdaMoeTextConfig.from_pretrained(tmp_path)
    assert _comparable(loaded) == _comparable(c)
    assert loaded.rope_parameters["rope_type"] == "yarn" and loaded.rope_parameters["factor"] == 4.0


def test_legacy_rope_theta_is_folded_into_rope_parameters():
    assert KdaMoeTextConfig(rope_theta=50000.0).rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}


# ---------------------------------------------------------------- published layouts

KIMI_LINEAR_FALLBACKS = {
    "gate_lower_bound": None,
    "use_full_rank_gate": False,
    "mla_use_output_gate": False,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "attn_res_block_size": None,
    "router_balancing": "none",
}


def test_native_kimi_linear_config_loads_with_kimi_linear_semantics(tmp_path):
    kimi = KimiLinearConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
        linear_num_heads=2, linear_head_dim=16, num_local_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, n_group=2, topk_group=1, moe_intermediate_size=32, intermediate_size=96,
        norm_topk_prob=False, max_position_embeddings=4096, routed_scaling_factor=2.5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    kimi.save_pretrained(tmp_path)
    for c in (KdaMoeTextConfig.from_pretrained(tmp_path), KdaMoeTextConfig.from_dict(kimi.to_dict())):
        assert c.layer_types == kimi.layer_types
        assert c.mlp_layer_types == kimi.mlp_layer_types
        assert (c.num_experts, c.num_experts_per_tok, c.num_shared_experts) == (8, 3, 2)
        assert (c.n_group, c.topk_group, c.moe_renormalize) == (2, 1, False)
        assert (c.max_position_embeddings, c.routed_scaling_factor) == (4096, 2.5)
        assert (c.linear_num_heads, c.linear_head_dim, c.num_attention_heads) == (2, 16, 2)
        assert {key: getattr(c, key) for key in KIMI_LINEAR_FALLBACKS} == KIMI_LINEAR_FALLBACKS
        assert c.model_type == "kda_moe_text" and c.to_dict()["model_type"] == "kda_moe_text"
        # the Kimi-only spellings are gone, so a re-save is in our own layout and loads back unchanged
        assert not {"num_experts_per_token", "model_max_length", "num_key_value_heads"} & set(c.to_dict())
        assert _comparable(KdaMoeTextConfig.from_dict(c.to_dict())) == _comparable(c)


def published_kimi_linear_dict(**changes):
    """A `config.json` in the remote-code layout of moonshotai/Kimi-Linear-48B-A3B-Instruct, at tiny sizes."""
    d = {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
        "model_type": "kimi_linear",
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 7, "intermediate_size": 96,
        "first_k_dense_replace": 2, "moe_layer_freq": 1, "head_dim": 72, "hidden_act": "silu",
        "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 32,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 4,
        "num_expert_group": 1, "num_experts": 16, "num_experts_per_token": 4, "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0, "num_shared_experts": 1, "use_grouped_topk": True, "topk_group": 1,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7],
            "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 3,
        },
    }  # fmt: skip
    d.update(changes)
    return d


def test_published_kimi_linear_layout_maps_every_key():
    for c in (KdaMoeTextConfig.from_dict(published_kimi_linear_dict()), KdaMoeTextConfig(**published_kimi_linear_dict())):
        assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2 + ["full_attention"]
        assert c.mlp_layer_types == ["dense", "dense"] + ["sparse"] * 5
        assert (c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim) == (2, 16, 3)
        assert (c.num_experts, c.num_experts_per_tok, c.num_shared_experts, c.n_group) == (16, 4, 1, 1)
        assert c.max_position_embeddings == 1048576 and c.q_lora_rank is None
        assert c.head_dim == c.qk_rope_head_dim == 4  # the published `head_dim` is derived, not taken
        assert {key: getattr(c, key) for key in KIMI_LINEAR_FALLBACKS} == KIMI_LINEAR_FALLBACKS
        saved = c.to_dict()
        assert not {"linear_attn_config", "first_k_dense_replace", "auto_map", "moe_router_activation_func"} & set(saved)


def test_published_k3_layout_keeps_the_k3_features_it_sets():
    d = published_kimi_linear_dict(
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=2,
        latent_moe_use_norm=True, mla_use_output_gate=True, routed_expert_hidden_size=32,
        first_k_dense_replace=1, routed_scaling_factor=1.0,
    )  # fmt: skip
    d["linear_attn_config"] = {**d["linear_attn_config"], "gate_lower_bound": -5.0, "use_full_rank_gate": True}
    c = KdaMoeTextConfig.from_dict(d)
    assert (c.hidden_act, c.attn_res_block_size, c.routed_expert_hidden_size) == ("situ", 2, 32)
    assert (c.gate_lower_bound, c.use_full_rank_gate, c.mla_use_output_gate, c.latent_moe_use_norm) == (-5.0, True, True, True)
    assert c.router_balancing == "none"  # not given: Kimi checkpoints carry their routing bias
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 6


def test_explicit_layer_types_win_over_linear_attn_config():
    d = published_kimi_linear_dict(layer_types=["linear_attention"] * 6 + ["full_attention"])
    assert KdaMoeTextConfig(**d).layer_types == ["linear_attention"] * 6 + ["full_attention"]


@pytest.mark.parametrize(
    "linear_attn_config, match",
    [
        ({"kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4]}, "neither"),
        ({"kda_layers": [1, 2, 3, 4, 5, 6], "full_attn_layers": [4, 7]}, "twice"),
        ({"kda_layers": [0, 1, 2, 3, 5, 6], "full_attn_layers": [4, 7]}, "1-based"),
    ],
)
def test_bad_linear_attn_config_schedule_is_refused(linear_attn_config, match):
    with pytest.raises(ValueError, match=f"linear_attn_config.*{match}"):
        KdaMoeTextConfig(**published_kimi_linear_dict(linear_attn_config=linear_attn_config))


def test_aliases_read_and_write_the_canonical_fields():
    c = KdaMoeTextConfig(num_experts_per_token=4, num_expert_group=2, topk_group=2, n_shared_experts=0)
    assert (c.num_experts_per_tok, c.n_group, c.num_shared_experts) == (4, 2, 0)
    assert c.num_experts_per_token == 4 and c.model_max_length == c.max_position_embeddings
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        KdaMoeTextConfig(num_experts_per_tok=2, num_experts_per_token=4)


def test_non_sigmoid_router_is_refused():
    with pytest.raises(ValueError, match="moe_router_activation_func"):
        KdaMoeTextConfig(**published_kimi_linear_dict(moe_router_activation_func="softmax"))


# ---------------------------------------------------------------- validation

BAD_VALUES = [
    ("num_experts_per_tok", {"num_experts_per_tok": 9}),
    ("num_experts_per_tok", {"num_experts_per_tok": 0}),
    ("topk_group", {"n_group": 2, "topk_group": 3}),
    ("n_group", {"n_group": 3}),
    ("num_experts_per_tok", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}),
    ("layer_types", {"layer_types": ["linear_attention"] * 3}),
    ("layer_types", {"layer_types": ["linear_attention"] * 3 + ["mamba2"]}),
    ("mlp_layer_types", {"mlp_layer_types": ["dense"] * 5}),
    ("mlp_layer_types", {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}),
    ("gate_lower_bound", {"gate_lower_bound": 0.0}),
    ("gate_lower_bound", {"gate_lower_bound": 0.5}),
    ("gate_lower_bound", {"gate_lower_bound": -6.0}),
    ("routed_expert_hidden_size", {"routed_expert_hidden_size": 257}),
    ("routed_expert_hidden_size", {"routed_expert_hidden_size": 0}),
    ("linear_num_heads", {"linear_num_heads": 0}),
    ("linear_head_dim", {"linear_head_dim": -1}),
    ("num_attention_heads", {"num_attention_heads": 0}),
    ("qk_nope_head_dim", {"qk_nope_head_dim": 0}),
    ("v_head_dim", {"v_head_dim": 0}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 7}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 0}),
    ("hidden_act", {"hidden_act": "gelu"}),
    ("router_balancing", {"router_balancing": "aux_loss"}),
    ("kernel_backend", {"kernel_backend": "cuda"}),
    ("num_shared_experts", {"num_shared_experts": -1}),
    ("linear_conv_kernel_dim", {"linear_conv_kernel_dim": 0}),
    ("attn_res_block_size", {"attn_res_block_size": 0}),
    ("activation_situ_beta", {"activation_situ_beta": 0.0}),
    ("activation_situ_linear_beta", {"activation_situ_linear_beta": -1.0}),
    ("q_lora_rank", {"q_lora_rank": 0}),
    ("kv_lora_rank", {"kv_lora_rank": 0}),
    ("num_experts", {"num_experts": -8}),
    ("num_hidden_layers", {"num_hidden_layers": 0, "layer_types": [], "mlp_layer_types": []}),
    ("hidden_size", {"hidden_size": 0}),
    ("vocab_size", {"vocab_size": 0}),
    ("moe_intermediate_size", {"moe_intermediate_size": 0}),
    ("intermediate_size", {"intermediate_size": 0}),
    ("router_balancing_bins", {"router_balancing_bins": 1}),
    ("router_bias_update_rate", {"router_bias_update_rate": -1e-3}),
    ("routed_scaling_factor", {"routed_scaling_factor": 0.0}),
    ("rms_norm_eps", {"rms_norm_eps": 0.0}),
    ("attention_dropout", {"attention_dropout": 1.0}),
    ("first_k_dense_replace", {"first_k_dense_replace": 5}),
    # wrong types, refused by @strict
    ("num_experts", {"num_experts": "8"}),
    ("use_full_rank_gate", {"use_full_rank_gate": "yes"}),
    ("gate_lower_bound", {"gate_lower_bound": "low"}),
    ("layer_types", {"layer_types": "full_attention"}),
]


@pytest.mark.parametrize("field, kwargs", BAD_VALUES, ids=[f"{f}={list(k.values())[-1]!r}" for f, k in BAD_VALUES])
def test_bad_value_raises_value_error_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        KdaMoeTextConfig(**kwargs)


def test_bad_assignment_after_init_raises_value_error():
    c = KdaMoeTextConfig()
    with pytest.raises(ValueError, match="num_experts"):
        c.num_experts = "many"
    c.num_experts_per_tok = 100  # cross-field checks run on validate(), e.g. in save_pretrained
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        c.validate()


def test_boundary_values_are_accepted():
    c = KdaMoeTextConfig(
        gate_lower_bound=-5.9, routed_expert_hidden_size=250, num_shared_experts=0, linear_conv_kernel_dim=1,
        attn_res_block_size=1, activation_situ_linear_beta=None, q_lora_rank=None, num_experts_per_tok=8,
        hidden_size=250, n_group=4, topk_group=4, hidden_act="silu", router_balancing="none", kernel_backend="torch",
    )  # fmt: skip
    assert c.hidden_size % c.num_attention_heads != 0  # MLA does not need hidden_size divisible by heads


# ---------------------------------------------------------------- checks on assignment and when a model is built

BAD_ASSIGNMENTS = [
    ("num_experts_per_tok", 0),
    ("num_experts", -8),
    ("hidden_act", "gelu"),
    ("gate_lower_bound", 0.5),
    ("qk_rope_head_dim", 7),
    ("layer_types", ["linear_attention", "mamba2", "linear_attention", "full_attention"]),
    ("kernel_backend", "cuda"),
    ("attention_dropout", 1.0),
    ("rms_norm_eps", 0.0),
    ("activation_situ_linear_beta", -1.0),
    ("router_balancing_bins", 1),
    ("routed_expert_hidden_size", 0),
]


@pytest.mark.parametrize("field, value", BAD_ASSIGNMENTS, ids=[f"{f}={v!r}" for f, v in BAD_ASSIGNMENTS])
def test_a_bad_value_set_after_construction_raises_at_once_naming_the_field(field, value):
    c = KdaMoeTextConfig()
    with pytest.raises(ValueError, match=f"field '{field}'"):
        setattr(c, field, value)
    assert getattr(c, field) == getattr(KdaMoeTextConfig(), field)  # the bad value was not stored


def test_an_alias_set_after_construction_is_checked_as_its_field():
    c = KdaMoeTextConfig()
    with pytest.raises(ValueError, match="field 'num_experts_per_tok'"):
        c.num_experts_per_token = 0
    c.num_experts_per_token = 3
    assert c.num_experts_per_tok == 3


def test_multi_field_edits_may_pass_through_any_order_and_are_checked_when_a_model_is_built():
    c = tiny_config()
    c.num_experts_per_tok = 12  # more than the 8 experts until the next line: rules relating fields wait
    c.num_experts = 16
    assert KdaMoeForCausalLM(c).model.layers[1].mlp.gate.weight.shape[0] == 16

    c.num_experts_per_tok = 100
    with pytest.raises(ValueError, match=r"`num_experts_per_tok`=100 is invalid: must be in \[1, num_experts=16\]"):
        KdaMoeForCausalLM(c)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        AutoModelForCausalLM.from_config(c)
    c.num_experts_per_tok = 2
    c.num_hidden_layers = 6
    with pytest.raises(ValueError, match=r"`layer_types`=.* needs one entry per layer, num_hidden_layers=6"):
        KdaMoeTextModel(c)


def test_rotary_width_follows_qk_rope_head_dim_set_after_construction():
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 2048}
    c = tiny_config(mla_use_nope=False, rope_parameters=yarn)
    c.qk_rope_head_dim = 8
    assert (c.head_dim, c.qk_head_dim) == (8, 16)
    model = KdaMoeForCausalLM(c).eval()
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, c.vocab_size)


# ---------------------------------------------------------------- unknown keys


def test_misspelled_keys_warn_naming_the_field_and_other_unknown_keys_are_kept(caplog):
    with caplog.at_level(logging.WARNING):
        c = KdaMoeTextConfig(num_expert_per_tok=4, linear_head_dims=16, my_experiment_tag="baseline")
    assert "`num_expert_per_tok`: did you mean `num_experts_per_tok`?" in caplog.text
    assert "`linear_head_dims`: did you mean `linear_head_dim`?" in caplog.text
    assert "my_experiment_tag" not in caplog.text
    assert c.my_experiment_tag == "baseline" and c.num_experts_per_tok == 2  # kept as transformers keeps them


def test_saved_published_and_transformers_written_keys_raise_no_misspelling_warning(tmp_path, caplog):
    written_by_transformers = {
        "architectures": ["KdaMoeForCausalLM"], "auto_map": {"AutoConfig": "configuration_kda_moe.KdaMoeTextConfig"},
        "transformers_version": "4.57.1", "torch_dtype": "float32", "dtype": "float32", "return_dict": True,
        "tie_encoder_decoder": False, "is_decoder": False, "sep_token_id": None, "output_attentions": False,
        "rope_theta": 10000.0, "max_length": 20, "top_k": 50, "_name_or_path": "x", "_commit_hash": None,
    }  # fmt: skip
    kimi = KimiLinearConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        KdaMoeTextConfig(**written_by_transformers)
        KdaMoeTextConfig(**published_kimi_linear_dict())
        KdaMoeTextConfig.from_dict(kimi.to_dict())
        tiny_model(seed=0).save_pretrained(tmp_path / "text")
        AutoModelForCausalLM.from_pretrained(tmp_path / "text")
        KdaMoeConfig().save_pretrained(tmp_path / "multimodal")
        KdaMoeConfig.from_pretrained(tmp_path / "multimodal")
    assert "did you mean" not in caplog.text
