"""Model cards of kda-moe checkpoints, text and multimodal.

`write_model_card(model, save_directory)` fills `CARD_TEMPLATE` (`template.py`) with an architecture summary read from
the model's config, its parameter counts, the intended use, the license and how to load the folder, and writes it as
the folder's `README.md` (the file the Hub shows). The models' `save_pretrained` calls it on the main process. A
`README.md` that this module did not write (no `GENERATED_MARK` in it) is left alone unless `overwrite=True`.

License: a card states the license passed as `license=` (an identifier the Hub knows, such as "apache-2.0" or "mit",
or "other"), and none otherwise: the weights are the user's, not kda-moe's. A card of ours that is written again (by
the next `save_pretrained` or push) keeps the license it states, so `write_model_card(model, folder, license="mit")`
once is enough. The card also says that the bundled `.py` files are kda-moe's code, under kda-moe's license.

`push_to_hub` (and `save_pretrained(..., push_to_hub=True)`) would upload transformers' card instead: the Hub's card,
or a generic one, from `create_and_tag_model_card`. The models' `_upload_modified_files` calls
`write_pushed_model_card`, which puts ours back (with the push's tags) unless the Hub's card is one someone wrote.
"""

from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .template import CARD_TEMPLATE

GENERATED_MARK = "<!-- kda-moe: generated model card; edit freely, kda-moe overwrites it only while this line is here -->"
TAGS = ["kda-moe", "kimi-delta-attention", "linear-attention", "multi-head-latent-attention", "mixture-of-experts"]
DEFAULT_MODEL_ID = "path/to/this/folder"
DEFAULT_INTENDED_USE = (
    "Research and experimentation with the kda-moe architecture (hybrid linear / latent attention, LatentMoE with "
    "Quantile Balancing): language-model pre-training, fine-tuning and long-context studies. A model is only as good "
    "as the data it was trained on; check the training section before using its generations for anything."
)
DEFAULT_TRAINING_SUMMARY = "Not recorded. Pass `training_summary=` to `write_model_card` to describe data and recipe."
# The license of kda-moe's own source code (the `.py` files a saved folder carries), as in its package metadata.
CODE_LICENSE = "Apache-2.0"
# The description of the card transformers' `create_and_tag_model_card` makes for a repository without one.
TRANSFORMERS_GENERIC_CARD_MARK = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."


def _is_multimodal(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Total, embedding (+ untied LM head), routed-expert and active-per-token parameter counts of `model`.

    Any device works, the meta device included: `with torch.device("meta"): model = KdaMoeForCausalLM(config)` counts
    a config's parameters without allocating them."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"parameter_counts takes a model, got {type(model).__name__}. To count a config's parameters, build the "
            'model on the meta device: `with torch.device("meta"): model = KdaMoeForCausalLM(config)`.'
        )
    text_config = model.config.get_text_config()
    total = embedding = routed = 0
    for name, parameter in model.named_parameters():  # tied embeddings count once
        count = parameter.numel()
        total += count
        if "embed_tokens" in name or name.startswith("lm_head"):
            embedding += count
        elif ".mlp.experts." in name:
            routed += count
    active = total - routed + routed * text_config.num_experts_per_tok // max(text_config.num_experts, 1)
    return {"total": total, "embedding": embedding, "routed_experts": routed, "active": active}


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count:,} ({count / size:.2f}{unit})"
    return f"{count:,}"


def architecture_rows(config) -> list[tuple[str, str]]:
    """(field, value) pairs summarising a text or multimodal config, the decoder's blocks in reading order first."""
    text = config.get_text_config()
    kda = text.layer_types.count("linear_attention")
    mla = text.layer_types.count("full_attention")
    sparse = text.mlp_layer_types.count("sparse")
    gate = "softplus (Kimi Linear)" if text.gate_lower_bound is None else f"bounded, lower bound {text.gate_lower_bound}"
    rows = [
        ("layers", f"{text.num_hidden_layers}: {kda} KDA + {mla} gated MLA"),
        ("hidden size / vocabulary", f"{text.hidden_size} / {text.vocab_size}"),
        ("KDA", f"{text.linear_num_heads} heads x {text.linear_head_dim}, conv {text.linear_conv_kernel_dim}, "
                f"decay gate {gate}, {'full-rank' if text.use_full_rank_gate else 'low-rank'} output gate"),
        ("MLA", f"{text.num_attention_heads} heads, q rank {text.q_lora_rank}, kv rank {text.kv_lora_rank}, "
                f"head dims {text.qk_nope_head_dim}+{text.qk_rope_head_dim} / {text.v_head_dim}, "
                f"{'NoPE' if text.mla_use_nope else 'RoPE'}, output gate {'on' if text.mla_use_output_gate else 'off'}"),
        ("MLP layers", f"{text.num_hidden_layers - sparse} dense (width {text.intermediate_size}) + {sparse} LatentMoE"),
        ("experts", f"{text.num_experts} routed (top-{text.num_experts_per_tok}) + {text.num_shared_experts} shared, "
                    f"width {text.moe_intermediate_size}, latent {text.routed_expert_hidden_size or 'none (full width)'}"),
        ("balancing", f"{text.router_balancing}"),
        ("activation", "SiTU-GLU" if text.hidden_act == "situ" else "SwiGLU"),
        ("residuals", "plain" if text.attn_res_block_size is None else f"Block AttnRes, block size {text.attn_res_block_size}"),
        ("max positions", f"{text.max_position_embeddings}"),
    ]  # fmt: skip
    if _is_multimodal(config):
        vision = config.vision_config
        merge = vision.spatial_merge_size
        rows += [
            ("vision tower", f"{vision.num_hidden_layers} layers, hidden {vision.hidden_size}, "
                             f"{vision.num_attention_heads} heads, {vision.patch_size}x{vision.patch_size} patches, "
                             f"native resolution with 2D RoPE"),
            ("image tokens", f"one per {merge}x{merge} merged patches (token id {config.image_token_id})"),
        ]  # fmt: skip
    return rows


def _usage(config, model_id: str, *, remote_code: bool) -> str:
    """The code that loads the folder: through its bundled source (`remote_code`) or through the installed package."""
    load_kwargs = ", trust_remote_code=True" if remote_code else ""
    lines = [] if remote_code else ["import kda_moe  # registers kda-moe's classes with the Auto factories"]
    if _is_multimodal(config):
        lines += [
            "from transformers import AutoModelForImageTextToText, AutoProcessor",
            "",
            f'model = AutoModelForImageTextToText.from_pretrained("{model_id}"{load_kwargs})',
            f'processor = AutoProcessor.from_pretrained("{model_id}"{load_kwargs})  # saved by processor.save_pretrained',
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{model_id}"{load_kwargs})',
        ]
    return "\n".join(lines)


def evaluation_text(eval_results: list[EvalResult] | None) -> str:
    """The card's evaluation section: a table of `eval_results`, or how to fill it."""
    if not eval_results:
        return (
            "Not evaluated yet. kda-moe's long-context suite (`evaluation/long_context.py` in its repository) scores a "
            "model folder and writes its results here: `python evaluation/long_context.py score --model FOLDER "
            "--suite SUITE --card`."
        )
    rows = [
        f"| {result.dataset_name} | {result.dataset_config or ''} | {result.metric_type} | {result.metric_value:.3f} |"
        for result in eval_results
    ]
    return "| task | context tokens | metric | value |\n|---|---|---|---|\n" + "\n".join(rows)


def model_card(
    model: torch.nn.Module,
    *,
    model_id: str = DEFAULT_MODEL_ID,
    model_name: str | None = None,
    license: str | None = None,
    intended_use: str = DEFAULT_INTENDED_USE,
    training_summary: str = DEFAULT_TRAINING_SUMMARY,
    datasets: list[str] | None = None,
    base_model: str | None = None,
    tags: list[str] | None = None,
    eval_results: list[EvalResult] | None = None,
) -> ModelCard:
    """The filled-in card of `model` (a `huggingface_hub.ModelCard`, metadata parsed strictly); `tags` add to
    kda-moe's own. `license=None` states no license for the model. `eval_results` (e.g. from
    `evaluation/long_context.py score --card`) become the card's `model-index` and its evaluation table."""
    config = model.config
    text = config.get_text_config()
    counts = parameter_counts(model)
    model_name = model_name or (Path(model_id).name if model_id != DEFAULT_MODEL_ID else "kda-moe model")
    data = ModelCardData(
        model_name=model_name if eval_results else None,
        license=license,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if _is_multimodal(config) else "text-generation",
        tags=TAGS + [tag for tag in tags or [] if tag not in TAGS],
        datasets=datasets,
        base_model=base_model,
        eval_results=eval_results or None,
    )
    model_license = f"The model is released under `{license}`." if license else "No license is stated for this model."
    body = CARD_TEMPLATE.substitute(
        generated_mark=GENERATED_MARK,
        model_name=model_name,
        model_kind="An image-text-to-text model (a native-resolution vision tower feeding a causal language model)"
        if _is_multimodal(config)
        else "A causal language model",
        residual_summary="Block Attention Residuals" if text.attn_res_block_size else "plain residuals",
        moe_summary="LatentMoE expert layer with SiTU-GLU experts and Quantile Balancing"
        if text.hidden_act == "situ"
        else "mixture-of-experts layer with SwiGLU experts",
        architecture_rows="\n".join(f"| {field} | {value} |" for field, value in architecture_rows(config)),
        total_parameters=_human(counts["total"]),
        embedding_parameters=_human(counts["embedding"]),
        routed_expert_parameters=_human(counts["routed_experts"]),
        active_parameters=_human(counts["active"]),
        experts_per_token=text.num_experts_per_tok,
        num_experts=text.num_experts,
        intended_use=intended_use,
        training_summary=training_summary,
        remote_code_usage=_usage(config, model_id, remote_code=True),
        package_usage=_usage(config, model_id, remote_code=False),
        evaluation=evaluation_text(eval_results),
        license_text=f"{model_license} The `.py` files in this folder are kda-moe's source code, under kda-moe's "
        f"license ({CODE_LICENSE}).",
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}", ignore_metadata_errors=False)


def _our_card(path: Path) -> ModelCard | None:
    """The card at `path` if this module wrote it (its license is kept when the card is written again), else None."""
    if not path.exists():
        return None
    card = ModelCard(path.read_text(encoding="utf-8", errors="replace"))
    return card if GENERATED_MARK in card.text else None


def write_model_card(model: torch.nn.Module, save_directory, *, overwrite: bool = False, **card_fields) -> Path | None:
    """Write the card as `save_directory/README.md` and return its path.

    Keeps a `README.md` someone else wrote (returns None) unless `overwrite`; `card_fields` go to `model_card`
    (`model_id` defaults to the folder's name; `license` and `eval_results` to those the folder's card of ours states,
    if any)."""
    path = Path(save_directory) / "README.md"
    previous = _our_card(path)
    if path.exists() and previous is None and not overwrite:
        return None
    card_fields.setdefault("model_id", Path(save_directory).resolve().name)
    card_fields.setdefault("license", previous.data.license if previous is not None else None)
    card_fields.setdefault("eval_results", previous.data.eval_results if previous is not None else None)
    model_card(model, **card_fields).save(path)
    return path


def write_pushed_model_card(model: torch.nn.Module, working_dir, repo_id: str) -> Path | None:
    """Replace the `README.md` transformers put in the folder it is about to upload to `repo_id` with our card.

    That file is `create_and_tag_model_card`'s: the Hub's card, or a generic one, either with the push's tags. A card
    someone wrote on the Hub (neither ours nor the generic one) is kept (returns None); otherwise the card is ours,
    named after `repo_id`, with the pushed card's tags, license and evaluation results."""
    path = Path(working_dir) / "README.md"
    pushed = ModelCard(path.read_text(encoding="utf-8")) if path.exists() else None
    if pushed is not None and GENERATED_MARK not in pushed.text and TRANSFORMERS_GENERIC_CARD_MARK not in pushed.text:
        return None
    tags = pushed.data.tags if pushed is not None else None
    license = pushed.data.license if pushed is not None else None
    eval_results = pushed.data.eval_results if pushed is not None else None
    tags = [tags] if isinstance(tags, str) else tags
    model_card(model, model_id=repo_id, tags=tags, license=license, eval_results=eval_results).save(path)
    return path


__all__ = [
    "write_model_card",
    "write_pushed_model_card",
    "model_card",
    "parameter_counts",
    "architecture_rows",
    "GENERATED_MARK",
]
