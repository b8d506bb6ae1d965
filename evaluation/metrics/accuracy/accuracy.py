"""Accuracy as a local `evaluate` metric: the fraction of predictions equal to their references.

Load it with `evaluate.load("evaluation/metrics/accuracy")` (a path: nothing is fetched from the Hub, so scoring runs
offline). It computes what the Hub's `accuracy` metric computes for integer labels (an unweighted mean of matches)
without its scikit-learn dependency; `evaluation/long_context.py` feeds it, per task and context length, the index of
the choice of highest log-likelihood and the index of the right one.
"""

import datasets
import evaluate

_DESCRIPTION = "Accuracy: the proportion of predictions that equal their reference labels."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`): predicted labels (for multiple choice, the index of the chosen answer).
    references (`list[int]`): reference labels (the index of the right answer).
Returns:
    accuracy (`float`): matches / predictions, in [0, 1] (0.0 for no predictions).
Example:
    >>> metric = evaluate.load("evaluation/metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 2, 3], references=[0, 1, 3, 3])["accuracy"]
    0.75
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        matches = sum(int(p == r) for p, r in zip(predictions, references, strict=True))
        return {"accuracy": matches / len(predictions) if predictions else 0.0}
