"""Agentic RL with TRL's `GRPOTrainer`: a kda-moe model learns to answer questions by calling tools.

    python examples/grpo_agentic.py --scale-down                    # tiny model on CPU, a few minutes
    python examples/grpo_agentic.py --scale-down --lora             # LoRA (attention, shared and routed experts)
    python examples/grpo_agentic.py --model path/to/model --output-dir outputs/grpo   # a real model on the GPU

The environment (`ToolEnvironment`) holds three tools executed in Python: a calculator, a key-value store and a
search over the bundled documents (`data/grpo_documents.jsonl`). TRL's multi-turn loop (`environment_factory`) renders
the tools into the prompt through the chat template (`processing/chat_template.jinja`, Kimi's tool-call format),
parses each reply with the tokenizer's `response_template` (`processor.parse_response`), runs every call on the
episode's own environment and appends the result as a `tool` turn until the model answers without calling a tool.

Reward = outcome (the final answer holds the expected value) + process (each well-formed tool call that ran earns a
share of `PROCESS_WEIGHT`; a failed call that a later successful call of the same tool recovers from earns it back).
TRL logs reward, tool-call frequency and failure rate, and completion length (episode length in tokens) per step,
with Trainer's progress bar; the script saves the model (or adapter) and reloads it as a check. LoRA on a model built
in the run saves that base to `OUTPUT_DIR/base` first, and the adapter's `base_model_name_or_path` names it, so
`AutoPeftModelForCausalLM.from_pretrained(OUTPUT_DIR)` reloads base + adapter offline.
"""

import argparse
import ast
import json
import operator
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent
DOCUMENTS = EXAMPLES / "data" / "grpo_documents.jsonl"
PROCESS_WEIGHT = 0.5


@dataclass
class RecipeConfig:
    """Everything a user sets. `scale_down` picks a tiny random model and CPU-sized batches."""

    model: str | None = None  # a saved kda-moe folder or Hub id; None builds a fresh model (tiny with scale_down)
    lora: bool = False
    scale_down: bool = False
    output_dir: str = "outputs/grpo_agentic"
    max_steps: int = 200
    num_tasks: int = 256
    learning_rate: float = 1e-5
    num_generations: int = 8  # G: completions per prompt, the group GRPO normalises rewards in
    per_device_batch_size: int = 8
    max_completion_length: int = 1024  # the whole episode: replies, tool calls and tool results
    max_tool_calling_iterations: int = 8
    cold_start_steps: int = 0  # supervised steps on demonstrations before RL (needed for a fresh model)
    temperature: float = 1.0
    # rollouts' KV cache: None (the dynamic cache) or "static" (`KdaMoeStaticCache`). TRL's generate() path passes
    # disable_compile=True, so the static cache runs eagerly there: no faster than the dynamic cache on CPU, and
    # the compiled (CUDA-graph) static decode step that makes it fast on a GPU is not reachable through GRPOConfig
    cache_implementation: str | None = None
    bf16: bool = False
    seed: int = 0

    def scaled_down(self) -> "RecipeConfig":
        return RecipeConfig(**{
            **asdict(self), "max_steps": min(self.max_steps, 20), "num_tasks": 32, "learning_rate": 1e-3,
            "num_generations": 4, "per_device_batch_size": 4, "max_completion_length": 48,
            "max_tool_calling_iterations": 2, "cold_start_steps": self.cold_start_steps or 150,
        })  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# The environment: tools executed in Python, with a record of every call for the process reward
# ---------------------------------------------------------------------------------------------------------------

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.Mod: operator.mod,
}  # fmt: skip


def evaluate_arithmetic(expression: str) -> float:
    """The value of an arithmetic expression of numbers and + - * / % ** (no names, no calls)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {ast.dump(node)}; use numbers and + - * / % ** only")

    return value(ast.parse(expression, mode="eval").body)


def load_documents(path: Path = DOCUMENTS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class ToolEnvironment:
    """One episode's tools. TRL calls `reset` with the task's row, exposes the public methods below as tools and
    passes the environments to the reward functions, which read `calls` (tool name, succeeded) in order."""

    def __init__(self, documents: list[dict] | None = None):
        self.documents = load_documents() if documents is None else documents
        self.store: dict[str, str] = {}
        self.calls: list[tuple[str, bool]] = []

    def reset(self, **row) -> None:
        self.store = dict(row.get("store") or {})
        self.calls = []

    def _record(self, name: str, run):
        try:
            result = run()
        except Exception:
            self.calls.append((name, False))
            raise  # TRL turns it into an {"error": ...} tool result the model sees
        self.calls.append((name, True))
        return result

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / % ** and parentheses, e.g. "12 * (3 + 4)".

        Returns:
            The value, as text.
        """
        return self._record("calculator", lambda: f"{evaluate_arithmetic(expression):g}")

    def kv_get(self, key: str) -> str:
        """Read a value from the key-value store.

        Args:
            key: the key to read.

        Returns:
            The stored value.
        """
        return self._record("kv_get", lambda: self.store[key])

    def kv_set(self, key: str, value: str) -> str:
        """Write a value into the key-value store.

        Args:
            key: the key to write.
            value: the value to store.

        Returns:
            "ok".
        """
        return self._record("kv_set", lambda: self.store.__setitem__(key, str(value)) or "ok")

    def search(self, query: str) -> str:
        """Search the harbour documents.

        Args:
            query: words to look for.

        Returns:
            The text of the best matching document.
        """

        def best():
            words = set(query.lower().split())
            if not words:
                raise ValueError("empty query: pass words to look for")
            return max(self.documents, key=lambda d: len(words & set((d["title"] + " " + d["text"]).lower().split())))["text"]

        return self._record("search", best)


# ---------------------------------------------------------------------------------------------------------------
# Tasks and rewards
# ---------------------------------------------------------------------------------------------------------------


TASK_TOOL = ("calculator", "kv_get", "search")  # the tool that answers each task kind of `make_tasks`


def make_tasks(n: int, seed: int = 0) -> list[dict]:
    """Questions answerable with the tools: arithmetic (calculator), a stored value (kv_get), a document fact
    (search). Each row: `prompt` (chat messages), `answer` (text the final reply must contain), `store`."""
    rng = random.Random(seed)
    facts = [("Who lights the lighthouse lamp?", "Mara Quill"), ("What is the name of the largest trawler?", "Northern Star"),
             ("How many passengers can the ferry carry?", "40"), ("Who is the headmistress of the harbour school?", "Ada Fenwick")]  # fmt: skip
    rows = []
    for i in range(n):
        kind = i % 3
        store = {}
        if kind == 0:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            question, answer = f"What is {a} * {b}? Use the calculator.", str(a * b)
        elif kind == 1:
            key, value = f"room{rng.randint(1, 9)}", str(rng.randint(100, 999))
            store = {key: value}
            question, answer = f"Read the value stored under {key!r} and tell it to me.", value
        else:
            question, answer = facts[rng.randrange(len(facts))]
            question += " Search the documents."
        call = {"calculator": {"expression": f"{a} * {b}"} if kind == 0 else None, "kv_get": {"key": next(iter(store), "")},
                "search": {"query": question}}[TASK_TOOL[kind]]  # fmt: skip
        rows.append({
            "prompt": [{"role": "user", "content": question}], "answer": answer, "store": store,
            "demonstration": {"name": TASK_TOOL[kind], "arguments": call},
        })  # fmt: skip
    return rows


def final_text(completion: list[dict]) -> str:
    """The content of the episode's last assistant message."""
    replies = [m for m in completion if m.get("role") == "assistant"]
    content = replies[-1].get("content") if replies else ""
    return content if isinstance(content, str) else " ".join(b.get("text", "") for b in content or [])


def outcome_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the final reply contains the expected answer, else 0."""
    return [float(expected.lower() in final_text(c).lower()) for c, expected in zip(completions, answer)]


def process_reward(completions, environments=None, **kwargs) -> list[float]:
    """PROCESS_WEIGHT * (successful calls + failures recovered by a later success of the same tool) / calls; 0 for an
    episode without a tool call. Malformed calls never reach the environment and count as failures in TRL's logs."""
    rewards = []
    for env in environments or [None] * len(completions):
        calls = env.calls if env is not None else []
        if not calls:
            rewards.append(0.0)
            continue
        recovered = sum(
            1 for i, (name, ok) in enumerate(calls) if not ok and any(n == name and k for n, k in calls[i + 1 :])
        )
        rewards.append(PROCESS_WEIGHT * (sum(ok for _, ok in calls) + recovered) / len(calls))
    return rewards


# ---------------------------------------------------------------------------------------------------------------
# Model, trainer, main
# ---------------------------------------------------------------------------------------------------------------


def load_processing_class():
    """The shipped tokenizer with the chat template and the response template that parses tool calls."""
    from kda_moe import KdaMoeProcessor

    processor = KdaMoeProcessor.from_package()
    tokenizer = processor.tokenizer
    tokenizer.chat_template = processor.chat_template
    tokenizer.padding_side = "left"  # GRPOTrainer's requirement
    return tokenizer


def build_model(config: RecipeConfig, tokenizer):
    import kda_moe  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig

    # the expert biases move at optimizer steps only, so every micro-batch of a step routes as its rollout did
    balancing = dict(router_bias_update="optimizer_step")
    if config.model:
        model = AutoModelForCausalLM.from_pretrained(config.model, **balancing)
    else:
        torch.manual_seed(config.seed)
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        sizes = dict(
            hidden_size=32, num_hidden_layers=4, linear_num_heads=2, linear_head_dim=8, num_attention_heads=2,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48, routed_expert_hidden_size=16,
        ) if config.scale_down else {}  # fmt: skip
        model = KdaMoeForCausalLM(KdaMoeTextConfig(vocab_size=len(tokenizer), **ids, **sizes, **balancing))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def demonstration_messages(row: dict, environment: ToolEnvironment) -> list[dict]:
    """One solved episode of a task: the user question, the right tool call, its result (run on `environment`) and
    the answer. Used to teach a fresh model the tool-call format before RL (`cold_start`)."""
    environment.reset(**row)
    name, arguments = row["demonstration"]["name"], row["demonstration"]["arguments"]
    result = getattr(environment, name)(**arguments)
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return row["prompt"] + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": result},
        {"role": "assistant", "content": row["answer"]},
    ]


def tool_schemas(environment: ToolEnvironment) -> list[dict]:
    from transformers.utils import get_json_schema

    return [get_json_schema(getattr(environment, name)) for name in ("calculator", "kv_get", "kv_set", "search")]


def cold_start(model, tokenizer, rows: list[dict], steps: int, learning_rate: float = 3e-3, batch_size: int = 8):
    """Supervised steps on demonstrations (loss on the assistant turns only), so that RL starts from a model that
    writes well-formed tool calls: a random model never calls a tool and GRPO would see only zero-variance groups."""
    environment = ToolEnvironment()
    tools = tool_schemas(environment)
    encoded = [
        tokenizer.apply_chat_template(
            demonstration_messages(row, environment), tools=tools, return_dict=True, return_assistant_tokens_mask=True
        )
        for row in rows
    ]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    model.train()
    generator = random.Random(0)
    for _ in range(steps):
        batch = generator.sample(encoded, min(batch_size, len(encoded)))
        width = max(len(e["input_ids"]) for e in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(batch):  # right padding: the labels stay aligned with their tokens
            ids, mask = torch.tensor(e["input_ids"]), torch.tensor(e["assistant_masks"], dtype=torch.bool)
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
            labels[i, : len(ids)] = ids.masked_fill(~mask, -100)
        device = model.device
        loss = model(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), labels=labels.to(device)
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def save_lora_base(model, tokenizer, base_dir: Path) -> None:
    """Save a base model that exists only in this process (fresh, or cold-started) to `base_dir` and point its
    `name_or_path` at that folder: PEFT writes it into the adapter's `base_model_name_or_path`, so
    `AutoPeftModelForCausalLM.from_pretrained(adapter_folder)` finds the base offline. The base's weights stay frozen
    under LoRA (the router's copy in `modules_to_save` is the one that trains), so the folder saved before training
    is the base of the trained adapter."""
    base_dir = base_dir.resolve()
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model.name_or_path = str(base_dir)


def build_trainer(config: RecipeConfig, model=None, tokenizer=None, environment_factory=ToolEnvironment):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tokenizer or load_processing_class()
    tasks = make_tasks(config.num_tasks, config.seed)
    if model is None:
        model = build_model(config, tokenizer)
        if config.cold_start_steps:
            cold_start(model, tokenizer, tasks, config.cold_start_steps)
    peft_config = None
    if config.lora:
        import importlib.util

        spec = importlib.util.spec_from_file_location("kda_moe_finetune_example", EXAMPLES / "finetune.py")
        finetune = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(finetune)
        peft_config = finetune.lora_config(r=8, alpha=16)
        if not model.name_or_path:
            save_lora_base(model, tokenizer, Path(config.output_dir) / "base")
    args = GRPOConfig(
        output_dir=config.output_dir,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        per_device_train_batch_size=config.per_device_batch_size,
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        max_tool_calling_iterations=config.max_tool_calling_iterations,
        temperature=config.temperature,
        cache_implementation=config.cache_implementation,
        bf16=config.bf16,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=config.seed,
        beta=0.0,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=[outcome_reward, process_reward],
        args=args,
        train_dataset=Dataset.from_list([{k: v for k, v in row.items() if k != "demonstration"} for row in tasks]),
        processing_class=tokenizer,
        environment_factory=environment_factory,
        peft_config=peft_config,
    )


def save_and_reload(trainer, output_dir: str):
    """Save the trained model (or adapter) with the tokenizer and load it back; returns the reloaded model. An
    adapter reloads with `AutoPeftModelForCausalLM` from the base its config names (`save_lora_base` for a model
    built in this run)."""
    import kda_moe  # noqa: F401  (registers the Auto classes: the saved folders load as the package's classes)

    trainer.save_model(output_dir)
    if hasattr(trainer.model, "peft_config"):
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(output_dir)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(output_dir)


def parse_args(argv=None) -> RecipeConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = RecipeConfig()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(value) if value is not None else str, default=value)
    config = RecipeConfig(**vars(parser.parse_args(argv)))
    return config.scaled_down() if config.scale_down else config


def main(argv=None) -> dict:
    config = parse_args(argv)
    trainer = build_trainer(config)
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    save_and_reload(trainer, config.output_dir)
    summary = {key: [entry.get(key) for entry in history] for key in ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length")}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
