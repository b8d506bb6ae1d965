"""Perplexity as a local `evaluate` metric: `exp(total negative log-likelihood / total scored tokens)`.

Load it with `evaluate.load("examples/metrics/perplexity")` (a path: nothing is fetched from the Hub). The Hub's
`perplexity` metric downloads its script and scores a model it loads by id itself; this one scores the
per-sequence sums that `examples/finetune.py` computes from the model it is training (`preprocess_logits_for_metrics`).
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Token-level perplexity from per-sequence negative log-likelihood sums and scored-token counts."
_KWARGS_DESCRIPTION = """
Args:
    nll_sum (`list[float]`): per sequence, the summed negative log-likelihood (natural log) of its scored tokens.
    token_count (`list[int]`): per sequence, how many tokens were scored.
Returns:
    perplexity (`float`): exp(sum(nll_sum) / sum(token_count)).
    mean_nll (`float`): sum(nll_sum) / sum(token_count), the mean cross-entropy in nats.
Example:
    >>> metric = evaluate.load("examples/metrics/perplexity")
    >>> metric.compute(nll_sum=[2.0, 4.0], token_count=[2, 4])["mean_nll"]
    1.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "token_count": datasets.Value("int64")}),
        )

    def _compute(self, nll_sum, token_count):
        tokens = sum(token_count)
        mean_nll = sum(nll_sum) / max(tokens, 1)
        return {"perplexity": math.exp(mean_nll), "mean_nll": mean_nll, "tokens": tokens}
