"""Long-context evaluation suite: data generators, lm-evaluation-harness task YAMLs, and a runner of our own.

    python evaluation/long_context.py write --lengths 4096 65536 262144 1048576 --out outputs/long_context
    lm_eval --model hf --model_args pretrained=MODEL,trust_remote_code=True --include_path outputs/long_context/tasks \\
        --tasks kda_long_context --batch_size 1
    python evaluation/long_context.py score --model MODEL --suite outputs/long_context --plot accuracy.png [--card]

Three tasks, each a multiple-choice question after a long context (chance = 1 / number of choices):
- `passkey`: a pass key hidden at a chosen depth (0 ... 1) of filler text (`examples/data/corpus.txt`);
- `kv_hops`: chained assignments (`Let A be B.` ... `Let B be 7.`) scattered through filler; the value of the first
  name needs several hops;
- `tool_trace`: a multi-step tool-use log in which a call fails (an injected error) and is retried; the question asks
  for the final stored result, and the value of the failed attempt is among the choices.
Lengths are in tokens of the tokenizer given (the filler is cut to fit). Every document records `task`, `length`,
`depth`, `context`, `question`, `choices` and `label`. `score` reads the same files and scores each choice by its
log-likelihood after context + question (what lm-evaluation-harness's `multiple_choice` does), batch by batch, and
computes the accuracy with `evaluate` (a local metric, `evaluation/metrics/accuracy`, so it needs no network).
"""

import argparse
import json
import math
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FILLER = ROOT / "examples" / "data" / "corpus.txt"
# a local `evaluate` metric (loaded by path, so scoring runs offline): what the Hub's `accuracy` computes
ACCURACY_METRIC = Path(__file__).resolve().parent / "metrics" / "accuracy"
TASKS = ("passkey", "kv_hops", "tool_trace")
WORDS = ("red", "blue", "green", "black", "white", "gold", "grey", "pink")
NAMES = ("Ava", "Ben", "Cal", "Dan", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kit", "Lea")
NUM_CHOICES = 4


def filler_sentences() -> list[str]:
    text = FILLER.read_text(encoding="utf-8")
    return [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.split()) > 3]


def _fill(tokenizer, facts: list[tuple[float, str]], length: int, rng: random.Random, sentences: list[str]) -> str:
    """Filler text of about `length` tokens with each fact (depth in [0, 1], sentence) placed at its depth."""
    fact_tokens = sum(len(tokenizer(f" {text}").input_ids) for _, text in facts)
    body, used, start = [], fact_tokens, rng.randrange(len(sentences))
    while used < length:
        sentence = sentences[(start + len(body)) % len(sentences)]
        used += len(tokenizer(f" {sentence}").input_ids)
        body.append(sentence)
    for depth, text in sorted(facts, key=lambda f: -f[0]):
        body.insert(round(depth * len(body)), text)
    return " ".join(body)


def _choices(answer: str, distractors: list[str], rng: random.Random) -> tuple[list[str], int]:
    choices = [answer] + rng.sample([d for d in dict.fromkeys(distractors) if d != answer], NUM_CHOICES - 1)
    rng.shuffle(choices)
    return [f" {c}" for c in choices], choices.index(answer)


def make_document(task: str, tokenizer, length: int, depth: float, rng: random.Random, sentences=None) -> dict:
    """One document of `task` with about `length` context tokens; `depth` places the decisive fact."""
    sentences = sentences or filler_sentences()
    if task == "passkey":
        answer = rng.choice(WORDS)
        facts = [(depth, f"The pass key is {answer}. Remember it.")]
        question, distractors = "What is the pass key? The pass key is", list(WORDS)
    elif task == "kv_hops":
        chain = rng.sample(NAMES, 3)
        answer = str(rng.randint(10, 99))
        links = [f"Let {a} be {b}." for a, b in zip(chain, chain[1:])] + [f"Let {chain[-1]} be {answer}."]
        rng.shuffle(links)
        facts = [(min(1.0, depth + 0.1 * i), link) for i, link in enumerate(links)]
        question = f"Follow the names. The value of {chain[0]} is"
        distractors = [str(rng.randint(10, 99)) for _ in range(12)]
    elif task == "tool_trace":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        wrong = a * b + rng.choice((-10, -1, 1, 10))
        answer = str(a * b)
        facts = [
            (depth, f"[call calculator({a} x {b})] -> error: unknown operator x."),
            (min(1.0, depth + 0.05), f"[call calculator({a} * {b})] -> {answer}."),
            (min(1.0, depth + 0.1), f"[call kv_set(total, {answer})] -> ok."),
        ]
        question = "After the retry, the stored total is"
        distractors = [str(wrong)] + [str(a * b + d) for d in (-2, 2, 3, -3, 5)]
    else:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    choices, label = _choices(answer, distractors, rng)
    return {"task": task, "length": length, "depth": depth, "context": _fill(tokenizer, facts, length, rng, sentences),
            "question": question, "choices": choices, "label": label}  # fmt: skip


def make_documents(task: str, tokenizer, length: int, count: int, seed: int = 0) -> list[dict]:
    """`count` documents with depths spread evenly over [0, 1]."""
    rng, sentences = random.Random(f"{task}-{length}-{seed}"), filler_sentences()
    return [make_document(task, tokenizer, length, i / max(count - 1, 1), rng, sentences) for i in range(count)]


TASK_YAML = """task: kda_{task}_{length}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\n{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_suite(out: Path, tokenizer, lengths: list[int], count: int, tasks=TASKS, seed: int = 0) -> list[Path]:
    """Write `data/{task}_{length}.jsonl` and lm-evaluation-harness YAMLs (`tasks/`, one task per file and a group
    `kda_long_context`) under `out`; returns the YAML paths."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    yamls, names = [], []
    for task in tasks:
        for length in lengths:
            data = out / "data" / f"{task}_{length}.jsonl"
            docs = make_documents(task, tokenizer, length, count, seed)
            data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
            path = out / "tasks" / f"kda_{task}_{length}.yaml"
            path.write_text(TASK_YAML.format(task=task, length=length, data=data.resolve()), encoding="utf-8")
            yamls.append(path)
            names.append(f"kda_{task}_{length}")
    group = out / "tasks" / "kda_long_context.yaml"
    group.write_text("group: kda_long_context\ntask:\n" + "".join(f"  - {n}\n" for n in names) + "metadata:\n  version: 1.0\n")
    return [*yamls, group]


def read_suite(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((out / "data").glob("*.jsonl")) for line in path.read_text().splitlines()]


PREFILL_CHUNK = 65536  # context tokens per forward: bounds a long context's activation memory


@torch.no_grad()
def choice_logliks(model, tokenizer, doc: dict, prefill_chunk: int = PREFILL_CHUNK) -> list[float]:
    """Log-likelihood of each choice after `context\nquestion`. The context runs once, `prefill_chunk` tokens per
    forward (batch 1, logits of its last token only, so a 1M-token context never materialises 1M x vocab logits nor
    a 1M-token forward's activations); a choice longer than one token continues from a copy of the context's cache."""
    import copy

    from kda_moe import prefill_in_chunks
    from kda_moe.compat import CACHE_NAME, output_cache

    device = model.device
    prefix = torch.tensor([tokenizer(f"{doc['context']}\n{doc['question']}").input_ids], device=device)
    out = prefill_in_chunks(model, prefix, chunk_size=prefill_chunk)
    first = out.logits[0, -1].float().log_softmax(-1)
    logliks = []
    for choice in doc["choices"]:
        option = tokenizer(choice, add_special_tokens=False).input_ids
        loglik = first[option[0]].item()
        if len(option) > 1:
            cache = {CACHE_NAME: copy.deepcopy(output_cache(out))}
            rest = model(input_ids=torch.tensor([option[:-1]], device=device), **cache).logits[0].float().log_softmax(-1)
            loglik += sum(rest[j, token].item() for j, token in enumerate(option[1:]))
        logliks.append(loglik)
    return logliks


def score(model, tokenizer, docs: list[dict], timings: dict | None = None,
          prefill_chunk: int = PREFILL_CHUNK) -> dict[tuple[str, int], float]:
    """Accuracy per (task, length), computed by `evaluate` (the local metric at `ACCURACY_METRIC`): the chosen answer
    is the choice of highest log-likelihood. With `timings` (a dict), also records per (task, length) the seconds per
    document and, on CUDA, the peak memory in GiB."""
    import time

    import evaluate

    accuracy = evaluate.load(str(ACCURACY_METRIC))
    model.eval()
    chosen: dict[tuple[str, int], tuple[list[int], list[int]]] = {}  # (predictions, references)
    for doc in docs:
        key = (doc["task"], doc["length"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logliks = choice_logliks(model, tokenizer, doc, prefill_chunk)
        predictions, references = chosen.setdefault(key, ([], []))
        predictions.append(max(range(len(logliks)), key=logliks.__getitem__))
        references.append(doc["label"])
        if timings is not None:
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            seconds, memory = timings.get(key, (0.0, peak))
            timings[key] = (seconds + time.perf_counter() - start, max(memory, peak))
    if timings is not None:
        for key in timings:
            timings[key] = (timings[key][0] / len(chosen[key][0]), timings[key][1])
    return {
        key: accuracy.compute(predictions=predictions, references=references)["accuracy"]
        for key, (predictions, references) in sorted(chosen.items())
    }


def train_tiny_model(tokenizer, tasks=TASKS, length: int = 48, steps: int = 200, batch_size: int = 16, seed: int = 0):
    """A tiny kda-moe model trained briefly (CPU, seconds to minutes) on fresh documents of the suite's tasks at a
    short length, with the loss on the answer's tokens only: what the suite scores. Returns (model, untrained copy)."""
    import copy

    from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig

    torch.manual_seed(seed)
    config = KdaMoeTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=4, linear_num_heads=2, linear_head_dim=32,
        num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
        routed_expert_hidden_size=None, pad_token_id=tokenizer.pad_token_id, kernel_backend="torch",
    )  # fmt: skip
    model = KdaMoeForCausalLM(config)
    untrained = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng, sentences = random.Random(seed + 1), filler_sentences()
    model.train()
    for _ in range(steps):
        docs = [make_document(tasks[i % len(tasks)], tokenizer, length, rng.random(), rng, sentences) for i in range(batch_size)]
        prompts = [tokenizer(f"{d['context']}\n{d['question']}").input_ids for d in docs]
        answers = [tokenizer(d["choices"][d["label"]], add_special_tokens=False).input_ids for d in docs]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        attention_mask, labels = torch.zeros_like(input_ids), torch.full_like(input_ids, -100)
        for row, (prompt, answer) in enumerate(zip(prompts, answers)):  # right padding
            end = len(prompt) + len(answer)
            input_ids[row, :end], attention_mask[row, :end] = torch.tensor(prompt + answer), 1
            labels[row, len(prompt) : end] = torch.tensor(answer)
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), untrained


TASK_NAMES = {"passkey": "pass-key retrieval", "kv_hops": "multi-hop key-value tracking",
              "tool_trace": "tool-use trace with error recovery"}  # fmt: skip


def eval_results(results: dict[tuple[str, int], float]) -> list:
    """The accuracies as `huggingface_hub.EvalResult`s: a model card's `model-index` (`write_model_card(...,
    eval_results=...)`), one per task and context length."""
    from huggingface_hub import EvalResult

    return [
        EvalResult(task_type="multiple-choice", dataset_type=f"kda_long_context_{task}", dataset_name=TASK_NAMES[task],
                   dataset_config=str(length), metric_type="accuracy", metric_value=round(accuracy, 4))
        for (task, length), accuracy in sorted(results.items())
    ]  # fmt: skip


def plot(results: dict[tuple[str, int], float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for task in sorted({t for t, _ in results}):
        points = sorted((length, acc) for (t, length), acc in results.items() if t == task)
        axis.plot(*zip(*points), marker="o", label=task)
    axis.axhline(1 / NUM_CHOICES, color="grey", linestyle="--", label="chance")
    axis.set(xscale="log", xlabel="context length (tokens)", ylabel="accuracy", ylim=(0, 1.05))
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv=None):
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("write", "score"))
    parser.add_argument("--out", "--suite", dest="out", type=Path, default=Path("outputs/long_context"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--count", type=int, default=20, help="documents per task and length")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="write: the tasks to write")
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                        help="score: context tokens per forward (bounds activation memory)")
    parser.add_argument("--model", help="model folder or Hub id (score)")
    parser.add_argument("--tokenizer", help="tokenizer (default: the model's, else the one shipped with kda-moe)")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--card", action="store_true",
                        help="score: write the accuracies into the model folder's card (model-index and table)")
    args = parser.parse_args(argv)
    if args.card and not (args.command == "score" and args.model and Path(args.model).is_dir()):
        raise ValueError(f"--card writes the scores into a local model folder's card; --model {args.model!r} is not one.")
    import kda_moe  # noqa: F401  (registers the Auto classes)
    from kda_moe.processing import TOKENIZER_DIR

    model_folder = Path(args.model) if args.model else None
    without_tokenizer = model_folder is None or (
        model_folder.is_dir() and not (model_folder / "tokenizer_config.json").exists()
    )
    tokenizer_source = args.tokenizer or str(TOKENIZER_DIR if without_tokenizer else model_folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    if args.command == "write":
        for path in write_suite(args.out, tokenizer, args.lengths, args.count, tasks=args.tasks):
            print(path)
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", device_map="auto")
    # a folder in the Kimi Linear layout (model_type kimi_linear) loads as transformers' own model, not ours
    print(f"scoring {type(model).__name__} ({model.config.model_type}, {model.dtype}, {model.device})")
    timings = {}
    results = score(model, tokenizer, read_suite(args.out), timings, args.prefill_chunk)
    for (task, length), acc in results.items():
        seconds, memory = timings[task, length]
        memory = "" if math.isnan(memory) else f"  peak {memory:.1f} GiB"  # NaN off CUDA
        print(f"{task:12s} {length:>9d} tokens  accuracy {acc:.3f}  {seconds:.2f} s/sequence{memory}")
    if args.plot:
        plot(results, args.plot)
    if args.card:
        from kda_moe.model_cards import write_model_card

        print(write_model_card(model, args.model, eval_results=eval_results(results)))


if __name__ == "__main__":
    main()
