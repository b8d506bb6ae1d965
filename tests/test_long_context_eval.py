"""The long-context evaluation suite (evaluation/long_context.py): generated documents put the decisive facts at the
asked depth and length, lm-evaluation-harness loads the written task YAMLs, and the runner's cached scoring equals a
full forward's log-likelihood."""

import importlib.util
import json
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "evaluation" / "long_context.py"


def suite():
    spec = importlib.util.spec_from_file_location("kda_moe_long_context_eval", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokenizer():
    from transformers import AutoTokenizer

    from kda_moe.processing import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.mark.parametrize("task", ["passkey", "kv_hops", "tool_trace"])
def test_documents_have_the_asked_length_and_place_the_fact_at_depth(task):
    lc, tok = suite(), tokenizer()
    shallow, deep = lc.make_documents(task, tok, 512, count=2)
    for doc in (shallow, deep):
        tokens = len(tok(doc["context"]).input_ids)
        assert 512 <= tokens < 512 + 80, tokens
        assert len(doc["choices"]) == lc.NUM_CHOICES and 0 <= doc["label"] < lc.NUM_CHOICES
    answer = shallow["choices"][shallow["label"]].strip()
    # depth 0 puts the decisive fact first, depth 1 near the end
    assert shallow["context"].find(answer) < len(shallow["context"]) // 4
    assert deep["context"].rfind(deep["choices"][deep["label"]].strip()) > len(deep["context"]) // 2
    if task == "tool_trace":
        assert "error" in shallow["context"] and "retry" in shallow["question"]


def test_lm_eval_loads_the_written_tasks(tmp_path):
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    lc, tok = suite(), tokenizer()
    lc.write_suite(tmp_path, tok, lengths=[256], count=3)
    manager = lm_eval_tasks.TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    loaded = manager.load(["kda_long_context"])
    tasks = loaded["tasks"]
    assert set(loaded["group_map"]["kda_long_context"]) == set(tasks)
    assert set(tasks) == {"kda_passkey_256", "kda_kv_hops_256", "kda_tool_trace_256"}
    task = tasks["kda_passkey_256"]
    doc = next(iter(task.test_docs()))
    written = json.loads((tmp_path / "data" / "passkey_256.jsonl").read_text().splitlines()[0])
    assert task.doc_to_text(doc) == f"{written['context']}\n{written['question']}"
    assert task.doc_to_choice(doc) == written["choices"] and task.doc_to_target(doc) == written["label"]


def test_lm_eval_hf_model_scores_our_saved_model_alike_at_batch_1_and_4_and_as_our_runner(tmp_path):
    """lm-evaluation-harness's `hf` model (`HFLM`) loads a saved model of ours unchanged (the package registers the
    Auto classes) and scores the suite's multiple-choice requests, built from the written task YAMLs as the harness
    builds them: the same log-likelihoods with one request a batch and four (right-padded), and our runner's."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    from conftest import tiny_model
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lc, tok = suite(), tokenizer()
    folder = tmp_path / "model"
    tiny_model(vocab_size=len(tok), pad_token_id=tok.pad_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    lc.write_suite(tmp_path / "suite", tok, lengths=[64, 96], count=2, tasks=("passkey", "kv_hops"))
    manager = lm_eval_tasks.TaskManager(include_path=str(tmp_path / "suite" / "tasks"), include_defaults=False)
    tasks = manager.load(["kda_long_context"])["tasks"]
    requests, docs = [], []
    for task in tasks.values():
        for doc in task.test_docs():
            docs.append(doc)
            context = task.doc_to_text(doc)
            requests += [Instance("loglikelihood", doc, (context, task.config.target_delimiter + choice), 0)
                         for choice in task.doc_to_choice(doc)]
    assert len(requests) == 2 * 2 * 2 * lc.NUM_CHOICES
    scored = {}
    for batch_size in (1, 4):
        lm = HFLM(pretrained=str(folder), backend="causal", batch_size=batch_size, device="cpu", dtype="float32")
        scored[batch_size] = [loglik for loglik, _ in lm.loglikelihood(requests)]
    assert scored[1] == pytest.approx(scored[4], abs=1e-4)
    ours = [loglik for doc in docs for loglik in lc.choice_logliks(lm.model, tok, doc)]
    assert scored[1] == pytest.approx(ours, abs=1e-4)


@pytest.mark.parametrize("prefill_chunk", [65536, 16])
def test_cached_choice_scoring_matches_full_sequence_loglikelihood(prefill_chunk):
    """The runner runs the context once, in forwards of `prefill_chunk` tokens, and continues each choice from a copy
    of its cache; the numbers equal the log-likelihood of the choice's tokens in one forward over context + choice."""
    import torch
    from conftest import tiny_model

    lc, tok = suite(), tokenizer()
    model = tiny_model(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    doc = lc.make_documents("kv_hops", tok, 64, count=1)[0]
    doc["choices"] = [" 42", " Mara Quill of the lighthouse"]  # one token and several tokens
    prefix = tok(f"{doc['context']}\n{doc['question']}").input_ids
    expected = []
    for choice in doc["choices"]:
        option = tok(choice, add_special_tokens=False).input_ids
        with torch.no_grad():
            logps = model(torch.tensor([prefix + option])).logits[0].float().log_softmax(-1)
        expected.append(sum(logps[len(prefix) + j - 1, t].item() for j, t in enumerate(option)))
    assert len(prefix) > 3 * 16  # the 16-token chunks split the context in several forwards
    assert lc.choice_logliks(model, tok, doc, prefill_chunk) == pytest.approx(expected, abs=1e-4)


def test_score_computes_the_accuracy_by_the_local_evaluate_metric_as_the_fraction_of_right_choices(monkeypatch):
    """`score` loads its accuracy metric from `evaluation/metrics/accuracy` with `evaluate` (a path, so offline) and
    returns, per task and length, the fraction of documents whose highest log-likelihood choice is the labelled one."""
    evaluate = pytest.importorskip("evaluate")
    from conftest import tiny_model

    lc, tok = suite(), tokenizer()
    metric = evaluate.load(str(lc.ACCURACY_METRIC))
    assert metric.compute(predictions=[0, 1, 2, 3], references=[0, 1, 3, 3]) == {"accuracy": 0.75}
    # a tiny model's own choices: the hand count over `choice_logliks` equals `score`
    model = tiny_model(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    docs = [doc for task in ("passkey", "tool_trace") for doc in lc.make_documents(task, tok, 48, count=3)]
    for i, doc in enumerate(docs):
        doc["label"] = i % lc.NUM_CHOICES  # the labels spread, so neither accuracy is 0 or 1 by construction alone
    right = {}
    for doc in docs:
        logliks = lc.choice_logliks(model, tok, doc)
        right.setdefault((doc["task"], doc["length"]), []).append(logliks.index(max(logliks)) == doc["label"])
    assert lc.score(model, tok, docs) == {key: sum(v) / len(v) for key, v in right.items()}
    # set choices: 3 of 4 right at one length, 1 of 3 at another, 0 of 1 at a third
    picks = {"a": 0, "b": 1, "c": 2, "d": 3}
    monkeypatch.setattr(lc, "choice_logliks", lambda model, tok, doc, chunk: [float(i == picks[doc["context"]])
                                                                            for i in range(lc.NUM_CHOICES)])
    cases = [(64, "a", 0), (64, "b", 1), (64, "c", 2), (64, "d", 0), (128, "a", 0), (128, "b", 0), (128, "c", 0),
             (256, "d", 0)]  # fmt: skip
    docs = [{"task": "passkey", "length": n, "context": c, "label": label} for n, c, label in cases]
    assert lc.score(model, tok, docs) == {("passkey", 64): 3 / 4, ("passkey", 128): 1 / 3, ("passkey", 256): 0.0}



def test_a_briefly_trained_tiny_model_solves_every_task_far_above_chance():
    """`train_tiny_model` on all three tasks in 48-token contexts (210 steps, the tasks in turn within each batch),
    then the suite's own scoring on fresh documents at 64 and 128 tokens, the decisive facts at every depth: chance is
    1 / 4. The pass key is the quickest to learn; the key-value chains and the tool traces (whose choices are numbers
    a few apart, the failed attempt's among them) take most of the steps."""
    lc, tok = suite(), tokenizer()
    model, untrained = lc.train_tiny_model(tok, tasks=lc.TASKS, length=48, steps=210)
    docs = [doc for task in lc.TASKS for length in (64, 128) for doc in lc.make_documents(task, tok, length, 16, seed=5)]
    trained, before = lc.score(model, tok, docs), lc.score(untrained, tok, docs)
    floors = {"passkey": 0.6, "kv_hops": 0.55, "tool_trace": 0.55}
    for task in lc.TASKS:
        for length in (64, 128):
            assert trained[task, length] >= floors[task], (task, length, trained, before)
            assert trained[task, length] >= before[task, length] + 0.25, (task, length, trained, before)


def test_score_writes_the_accuracies_into_the_model_folders_card(tmp_path, capsys):
    """`score --card` on a saved tiny model: it names the class it scores, and the card's model-index holds one
    accuracy per task and length, the ones `score` computes."""
    from conftest import tiny_model
    from huggingface_hub import ModelCard

    lc, tok = suite(), tokenizer()
    model = tiny_model(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    lc.write_suite(tmp_path / "suite", tok, lengths=[64], count=2)
    lc.main(["score", "--model", str(tmp_path / "model"), "--suite", str(tmp_path / "suite"), "--card"])
    assert f"scoring {type(model).__name__} ({model.config.model_type}" in capsys.readouterr().out
    expected = lc.score(model, tok, lc.read_suite(tmp_path / "suite"))
    card = ModelCard.load(tmp_path / "model" / "README.md", ignore_metadata_errors=False)
    got = {(r.dataset_type.removeprefix("kda_long_context_"), int(r.dataset_config)): r.metric_value
           for r in card.data.eval_results}  # fmt: skip
    assert got == pytest.approx(expected) and len(got) == 3
    with pytest.raises(ValueError, match="local model folder"):
        lc.main(["score", "--model", "someone/on-the-hub", "--suite", str(tmp_path / "suite"), "--card"])


def test_score_plot_writes_a_png_of_accuracy_against_context_length(tmp_path, capsys):
    """`score --plot PATH` on a saved tiny model writes a PNG that Pillow opens and verifies (the figure's 6 x 4
    inches at matplotlib's default 100 dpi)."""
    pytest.importorskip("matplotlib")
    from conftest import tiny_model
    from PIL import Image

    lc, tok = suite(), tokenizer()
    model = tiny_model(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    lc.write_suite(tmp_path / "suite", tok, lengths=[48, 64], count=1, tasks=("passkey", "kv_hops"))
    path = tmp_path / "accuracy.png"
    lc.main(["score", "--model", str(tmp_path / "model"), "--suite", str(tmp_path / "suite"), "--plot", str(path)])
    assert "accuracy" in capsys.readouterr().out
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (600, 400), (image.format, image.size)
