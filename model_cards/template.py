"""The model card template (`string.Template` placeholders), kept as Python source so that it travels with the code:
a folder saved by a model loaded with `trust_remote_code=True` is written by the copy of `model_cards` in transformers'
module cache, and that cache holds `.py` files only."""

from string import Template

CARD_TEMPLATE = Template(
    """\
$generated_mark
# $model_name

$model_kind built with kda-moe, the Kimi K3 / Kimi Linear architecture for Hugging Face `transformers`: Kimi Delta
Attention (linear attention with a channel-wise decay) hybridised with gated Multi-head Latent Attention,
$residual_summary, and a $moe_summary.

## Architecture

| field | value |
|---|---|
$architecture_rows

## Parameters

| | count |
|---|---|
| total | $total_parameters |
| embeddings and LM head | $embedding_parameters |
| routed experts | $routed_expert_parameters |
| active per token | $active_parameters |

"Active per token" counts every parameter a token passes through: everything except the routed experts, plus
$experts_per_token of the $num_experts routed experts of each MoE layer.

## Intended use

$intended_use

## Training

$training_summary

## Evaluation

$evaluation

## How to use

The folder carries the kda-moe source code it runs (the `.py` files beside the weights; `config.json`'s `auto_map`
names its classes), so `transformers` and `torch` are all it needs; `trust_remote_code=True` lets transformers run
that code:

```python
$remote_code_usage
```

On CPU the model runs its PyTorch reference; on CUDA it runs kda-moe's Triton kernels where `triton` is installed.
Where kda-moe itself is installed, `import kda_moe` registers its classes with the Auto factories, and the folder loads
with the installed code instead:

```python
$package_usage
```

Quantile Balancing's expert biases (`e_score_correction_bias`) are part of the weights; fine-tuning keeps updating
them in training mode.

## License

$license_text
"""
)
