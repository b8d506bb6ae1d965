"""Model cards for kda-moe checkpoints.

`write_model_card(model_or_config, save_directory)` fills `template.md` with an architecture summary read from the
config, the parameter counts, the intended use, the license and how to load the folder, and writes it as the
folder's `README.md` (the file the Hub shows). `KdaMoePreTrainedModel.save_pretrained` calls it on the main process.
A `README.md` that this module did not write (no `GENERATED_MARK` in it) is left alone unless `overwrite=True`.

`push_to_hub` (and `save_pretrained(..., push_to_hub=True)`) would upload transformers' card instead: the Hub's card,
or a generic one, from `create_and_tag_model_card`. `KdaMoePreTrainedModel._upload_modified_files` calls
`write_pushed_model_card`, which puts ours back (with the push's tags) unless the Hub's card is one someone wrote.
"""

from pathlib import Path
from string import Template

import torch
from huggingface_hub import ModelCard, ModelCardData

TEMPLATE_PATH = Path(__file__).with_name("template.md")
GENERATED_MARK = "<!-- kda-moe: generated model card; edit freely, kda-moe overwrites it only while this line is here -->"
TAGS = ["kda-moe", "kimi-delta-attention", "linear-attention", "multi-head-latent-attention", "mixture-of-experts"]
DEFAULT_MODEL_ID = "path/to/this/folder"
DEFAULT_INTENDED_USE = (
    "Research and experimentation with the kda-moe architecture (hybrid linear / latent attention, LatentMoE with "
    "Quantile Balancing): language-model pre-training, fine-tuning and long-context studies. A model is only as good "
    "as the data it was trained on; check the training section before using its generations for anything."
)
DEFAULT_TRAINING_SUMMARY = "Not recorded. Pass `training_summary=` to `write_model_card` to describe data and recipe."
# The description of the card transformers' `create_and_tag_model_card` makes for a repository without one.
TRANSFORMERS_GENERIC_CARD_MARK = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."


def _config_of(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def parameter_counts(model_or_config) -> dict[str, int]:
    """Total, embedding (+ untied LM head), routed-expert and active-per-token parameter counts.

    A config is measured on a model built on the meta device (no memory, any size)."""
    from ..modeling import KdaMoeForCausalLM

    model = model_or_config
    if not isinstance(model, torch.nn.Module):
        with torch.device("meta"):
            model = KdaMoeForCausalLM(_config_of(model_or_config))
    config = _config_of(model)
    total = embedding = routed = 0
    seen = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:  # tied embeddings count once
            continue
        seen.add(id(parameter))
        count = parameter.numel()
        total += count
        if "embed_tokens" in name or name.startswith("lm_head"):
            embedding += count
        elif ".mlp.experts." in name:
            routed += count
    active = total - routed + routed * config.num_experts_per_tok // max(config.num_experts, 1)
    return {"total": total, "embedding": embedding, "routed_experts": routed, "active": active}


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count:,} ({count / size:.2f}{unit})"
    return f"{count:,}"


def architecture_rows(config) -> list[tuple[str, str]]:
    """(field, value) pairs summarising the config, in the order the README describes the blocks."""
    kda = config.layer_types.count("linear_attention")
    mla = config.layer_types.count("full_attention")
    sparse = config.mlp_layer_types.count("sparse")
    gate = "softplus (Kimi Linear)" if config.gate_lower_bound is None else f"bounded, lower bound {config.gate_lower_bound}"
    rows = [
        ("layers", f"{config.num_hidden_layers}: {kda} KDA + {mla} gated MLA"),
        ("hidden size / vocabulary", f"{config.hidden_size} / {config.vocab_size}"),
        ("KDA", f"{config.linear_num_heads} heads x {config.linear_head_dim}, conv {config.linear_conv_kernel_dim}, "
                f"decay gate {gate}, {'full-rank' if config.use_full_rank_gate else 'low-rank'} output gate"),
        ("MLA", f"{config.num_attention_heads} heads, q rank {config.q_lora_rank}, kv rank {config.kv_lora_rank}, "
                f"head dims {config.qk_nope_head_dim}+{config.qk_rope_head_dim} / {config.v_head_dim}, "
                f"{'NoPE' if config.mla_use_nope else 'RoPE'}, output gate {'on' if config.mla_use_output_gate else 'off'}"),
        ("MLP layers", f"{config.num_hidden_layers - sparse} dense (width {config.intermediate_size}) + {sparse} LatentMoE"),
        ("experts", f"{config.num_experts} routed (top-{config.num_experts_per_tok}) + {config.num_shared_experts} shared, "
                    f"width {config.moe_intermediate_size}, latent {config.routed_expert_hidden_size or 'none (full width)'}"),
        ("balancing", f"{config.router_balancing}"),
        ("activation", "SiTU-GLU" if config.hidden_act == "situ" else "SwiGLU"),
        ("residuals", "plain" if config.attn_res_block_size is None else f"Block AttnRes, block size {config.attn_res_block_size}"),
        ("max positions", f"{config.max_position_embeddings}"),
    ]
    return rows


def model_card(
    model_or_config,
    *,
    model_id: str = DEFAULT_MODEL_ID,
    model_name: str | None = None,
    license: str = "apache-2.0",
    intended_use: str = DEFAULT_INTENDED_USE,
    training_summary: str = DEFAULT_TRAINING_SUMMARY,
    datasets: list[str] | None = None,
    base_model: str | None = None,
    tags: list[str] | None = None,
) -> ModelCard:
    """The filled-in card (a `huggingface_hub.ModelCard`, metadata parsed strictly); `tags` add to kda-moe's own."""
    config = _config_of(model_or_config)
    counts = parameter_counts(model_or_config)
    data = ModelCardData(
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS + [tag for tag in tags or [] if tag not in TAGS],
        datasets=datasets,
        base_model=base_model,
    )
    body = Template(TEMPLATE_PATH.read_text()).substitute(
        generated_mark=GENERATED_MARK,
        model_name=model_name or (Path(model_id).name if model_id != DEFAULT_MODEL_ID else "kda-moe model"),
        residual_summary="Block Attention Residuals" if config.attn_res_block_size else "plain residuals",
        moe_summary="LatentMoE expert layer with SiTU-GLU experts and Quantile Balancing"
        if config.hidden_act == "situ"
        else "mixture-of-experts layer with SwiGLU experts",
        architecture_rows="\n".join(f"| {field} | {value} |" for field, value in architecture_rows(config)),
        total_parameters=_human(counts["total"]),
        embedding_parameters=_human(counts["embedding"]),
        routed_expert_parameters=_human(counts["routed_experts"]),
        active_parameters=_human(counts["active"]),
        experts_per_token=config.num_experts_per_tok,
        num_experts=config.num_experts,
        intended_use=intended_use,
        training_summary=training_summary,
        model_id=model_id,
        license_text=f"`{license}`" + (" (the same as kda-moe itself)" if license == "apache-2.0" else ""),
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}", ignore_metadata_errors=False)


def write_model_card(model_or_config, save_directory, *, overwrite: bool = False, **card_fields) -> Path | None:
    """Write the card as `save_directory/README.md` and return its path.

    Keeps a `README.md` someone else wrote (returns None) unless `overwrite`; `card_fields` go to `model_card`
    (`model_id` defaults to the folder's name)."""
    path = Path(save_directory) / "README.md"
    if path.exists() and not overwrite and GENERATED_MARK not in path.read_text(encoding="utf-8", errors="replace"):
        return None
    card_fields.setdefault("model_id", Path(save_directory).resolve().name)
    model_card(model_or_config, **card_fields).save(path)
    return path


def write_pushed_model_card(model, working_dir, repo_id: str) -> Path | None:
    """Replace the `README.md` transformers put in the folder it is about to upload to `repo_id` with our card.

    That file is `create_and_tag_model_card`'s: the Hub's card, or a generic one, either with the push's tags. A card
    someone wrote on the Hub (neither ours nor the generic one) is kept (returns None); otherwise the card is ours,
    named after `repo_id`, with the pushed card's tags added."""
    path = Path(working_dir) / "README.md"
    pushed = ModelCard(path.read_text(encoding="utf-8")) if path.exists() else None
    if pushed is not None and GENERATED_MARK not in pushed.text and TRANSFORMERS_GENERIC_CARD_MARK not in pushed.text:
        return None
    tags = pushed.data.tags if pushed is not None else None
    model_card(model, model_id=repo_id, tags=[tags] if isinstance(tags, str) else tags).save(path)
    return path


__all__ = [
    "write_model_card",
    "write_pushed_model_card",
    "model_card",
    "parameter_counts",
    "architecture_rows",
    "GENERATED_MARK",
]
