"""RL numerics and the agentic GRPO recipe (examples/grpo_agentic.py).

The log-probabilities of a rollout (a no-grad forward, or generate()'s logits) and of the training forward must agree:
any difference is an on-policy importance ratio != 1 that the RL trainer cannot tell from a policy change. Quantile
Balancing keeps adapting during GRPO as it does under `Trainer`."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from kda_testing import rel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def grpo_example():
    spec = importlib.util.spec_from_file_location("kda_moe_grpo_example", EXAMPLES / "grpo_agentic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def left_padded_batch(vocab_size, rows=6, width=24):
    """Rows of random tokens, row i left-padded by i tokens (pad id 0)."""
    input_ids = torch.randint(1, vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    for i in range(rows):
        attention_mask[i, :i] = 0
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def token_logps(model, input_ids, attention_mask, grad: bool, autocast: bool = True):
    """log p(token t | tokens < t) for t >= 1, [B, T-1] fp32, computed like TRL (logits in fp32, log-softmax)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def test_rollout_and_training_logps_are_identical_under_any_row_order():
    model = tiny_model()
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    rollout = token_logps(model.eval(), input_ids, attention_mask, grad=False)
    model.train()  # the training forward: train mode (Quantile Balancing stages its update), autograd on
    for permutation in (torch.arange(6).flip(0), torch.tensor([3, 0, 5, 1, 4, 2])):
        training = token_logps(model, input_ids[permutation], attention_mask[permutation], grad=True)
        ratio = torch.exp(training.detach()[permutation.argsort()] - rollout)
        valid = attention_mask[:, 1:].bool()
        assert torch.equal(ratio[valid], torch.ones_like(ratio[valid])), (ratio[valid] - 1).abs().max()
    # One row at a time (micro-batch 1) gives the same numbers as the whole batch.
    single = torch.cat([token_logps(model, input_ids[i : i + 1], attention_mask[i : i + 1], grad=True) for i in range(6)])
    assert torch.equal(single.detach()[valid], rollout[valid])



def rl_model(**overrides):
    """A tiny model with TRL's fused LM head added, as `GRPOTrainer` adds it (TRL >= 1.0)."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = tiny_model(**overrides)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def completion_logps(model, head, input_ids, labels, autocast=True, **inputs):
    """Training forward (autograd on) under bf16 autocast: the log-probabilities of the labelled tokens, flattened
    [N] fp32 in row order. head "logits": log-softmax of the fp32 logits, as `token_logps`; "fused": TRL
    `GRPOTrainer`'s `model(..., labels=labels, fused_lm_head=True).log_probs`."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.enable_grad():
        if head == "fused":
            logps = model(input_ids=input_ids, labels=labels, fused_lm_head=True, **inputs).log_probs
        else:
            logits = model(input_ids=input_ids, **inputs).logits[:, :-1].float()
            logps = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return logps[labels[:, 1:] != -100]


def grpo_batch(vocab_size, prompt_lengths=(10, 7, 3, 9, 5, 1), completion_lengths=(14, 3, 11, 1, 8, 14)):
    """(sequences, labels): prompt + completion token lists, the labels -100 on the prompt (GRPO scores the
    completion only)."""
    generator = torch.Generator().manual_seed(0)
    sequences, labels = [], []
    for p, c in zip(prompt_lengths, completion_lengths):
        tokens = torch.randint(1, vocab_size, (p + c,), generator=generator)
        sequences.append(tokens)
        labels.append(tokens.masked_fill(torch.arange(p + c) < p, -100))
    return sequences, labels


def padded(sequences, labels, left):
    """Rows of one width, pad id 0: each row padded by left[i] tokens on the left and the rest on the right (GRPO
    left-pads the prompts and right-pads the completions)."""
    width = max(l + len(s) for l, s in zip(left, sequences))
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    label_rows = torch.full_like(input_ids, -100)
    attention_mask = torch.zeros_like(input_ids)
    for i, (l, s, y) in enumerate(zip(left, sequences, labels)):
        input_ids[i, l : l + len(s)], label_rows[i, l : l + len(s)], attention_mask[i, l : l + len(s)] = s, y, 1
    return {"input_ids": input_ids, "labels": label_rows, "attention_mask": attention_mask}


def packed(sequences, labels):
    """One row, position ids restarting at 0 per sequence, no attention mask (padding-free packing)."""
    return {
        "input_ids": torch.cat(sequences)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in sequences])[None],
    }


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("head", ["logits", "fused"])
def test_gradient_checkpointing_keeps_the_training_logps_and_the_policy_gradient(head, reentrant):
    """Activation checkpointing (GRPOConfig's default) recomputes each decoder layer in the backward: the training
    log-probabilities and the gradients of a GRPO-like loss (sum of log-probabilities times advantages) are those of
    the forward without it under bf16 autocast with Quantile Balancing on: bit for bit, reentrant checkpointing's
    gradients to fp32 rounding."""
    input_ids, attention_mask = left_padded_batch(97)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    advantages = torch.randn(int(attention_mask[:, 1:].sum()), generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointing in (False, True):
        model = rl_model().train()  # a fresh model each time: the backward applies Quantile Balancing's staged bias
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": reentrant})
        calls = []
        next(model.model.layers[0].children()).register_forward_hook(lambda *args: calls.append(1))
        logps = completion_logps(model, head, input_ids, labels, attention_mask=attention_mask)
        (logps * advantages).sum().backward()
        assert len(calls) == (2 if checkpointing else 1), "the checkpointed layer's modules run again in the backward"
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), grads))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    assert torch.equal(checkpointed, plain), (checkpointed - plain).abs().max()
    assert plain_grads.keys() == checkpointed_grads.keys() and len(plain_grads) > 100
    for name, grad in plain_grads.items():
        if reentrant:  # the backward of each recomputed layer returns its input gradients on their own, which are
            # summed into the embedding's and the AttnRes blocks' gradients in another order: fp32 rounding
            torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(checkpointed_grads[name], grad), (name, (checkpointed_grads[name] - grad).abs().max())


@pytest.mark.parametrize("head", ["logits", "fused"])
def test_packed_training_logps_equal_the_padded_rows(head):
    """Padding-free packing (one row, position ids restarting per sequence) gives the training log-probabilities of
    the completions that the sequences get alone and in right-padded rows, bit for bit under bf16 autocast.

    Left padding keeps the function but not the bf16 rounding: the chunked KDA core (fp32, chunks of 64 tokens cut
    into tiles of 16) splits its sums where the chunks and tiles fall, so a sequence that starts k tokens into its
    row rounds its fp32 KDA outputs differently (~1e-7) unless k is a multiple of 64; under bf16 autocast the next
    bf16 cast flips some of those roundings into bf16-size differences of the log-probabilities. Packed and
    left-padded agree to fp32 rounding without autocast; under autocast, rows padded by whole chunks agree bit for bit.
    A rollout and a training forward of one layout (both packed, or both in the same padded rows, as
    `GRPOTrainer` runs them) agree bit for bit."""
    model = rl_model().train()
    sequences, labels = grpo_batch(model.config.vocab_size)
    one_row = completion_logps(model, head, **packed(sequences, labels))
    alone = torch.cat([completion_logps(model, head, s[None], y[None]) for s, y in zip(sequences, labels)])
    assert torch.equal(one_row, alone), (one_row - alone).abs().max()
    right_padded = completion_logps(model, head, **padded(sequences, labels, left=[0] * len(sequences)))
    assert torch.equal(one_row, right_padded), (one_row - right_padded).abs().max()
    chunk_padded = completion_logps(model, head, **padded(sequences, labels, left=[64 * (i % 3) for i in range(6)]))
    assert torch.equal(one_row, chunk_padded), (one_row - chunk_padded).abs().max()
    # GRPO's layout: prompts left-padded to the longest, completions right-padded.
    left = [10 - int((y == -100).sum()) for y in labels]  # prompts of up to 10 tokens
    one_row_fp32 = completion_logps(model, head, **packed(sequences, labels), autocast=False)
    left_padded_fp32 = completion_logps(model, head, **padded(sequences, labels, left), autocast=False)
    torch.testing.assert_close(left_padded_fp32, one_row_fp32, rtol=0, atol=1e-5)  # fp32 rounding of logps ~ -5


@pytest.mark.parametrize("autocast, tolerance", [(False, 1e-5), (True, 1e-2)])
def test_generate_logits_match_the_training_forward(autocast, tolerance):
    """generate()'s per-step logits (cached decode: recurrent KDA, latent MLA cache) against one training forward of
    the finished sequences. fp32 agrees to rounding; under bf16 autocast the decode step and the full forward round
    different matmul shapes, so they agree to bf16 precision (TRL's ratio uses forwards only, see the test above)."""
    model = tiny_model()
    prompt, prompt_mask = left_padded_batch(model.config.vocab_size, rows=4, width=8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        out = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=10, do_sample=True, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    completion = out.sequences[:, prompt.shape[1] :]
    rollout = torch.stack([step.float().log_softmax(-1) for step in out.logits], 1).gather(-1, completion[..., None])[..., 0]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion)], 1)
    training = token_logps(model.train(), out.sequences, attention_mask, grad=True, autocast=autocast)[:, -10:]
    assert (training.detach() - rollout).abs().max() < tolerance


def router_biases(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def grpo_step_biases(tmp_path, seed, training_inputs=None, **config):
    """Router biases after one GRPO step (TRL's `GRPOTrainer`, plain-text prompts, a reward with variance). The
    arguments of every training forward (train mode, autograd on) are appended to `training_inputs`."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = grpo_example().load_processing_class()
    model = tiny_model(seed=seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **config)
    before = router_biases(model)
    if training_inputs is not None:

        def record(module, args, kwargs):
            if module.training and torch.is_grad_enabled():
                training_inputs.append((args, {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}))

        model.register_forward_pre_hook(record, with_kwargs=True)
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no", seed=seed,
        beta=0.0, logging_steps=1,
    )  # fmt: skip

    def even_tokens(completion_ids, **kwargs):
        return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]

    prompts = Dataset.from_list([{"prompt": f"The harbour bell rings at {i} o'clock."} for i in range(4)])
    trainer = GRPOTrainer(model=model, reward_funcs=even_tokens, args=args, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    assert trainer.state.log_history[0]["grad_norm"] > 0
    return before, router_biases(trainer.model)


def test_quantile_balancing_moves_during_grpo_and_reruns_identically(tmp_path):
    before, after = grpo_step_biases(tmp_path / "a", seed=0)
    assert before.keys() == after.keys() and before
    assert all(torch.count_nonzero(b) == 0 for b in before.values())
    assert all(torch.count_nonzero(after[n]) > 0 for n in after), "every MoE layer's bias moves in a GRPO step"
    _, rerun = grpo_step_biases(tmp_path / "b", seed=0)
    assert all(torch.equal(after[n], rerun[n]) for n in after)


def test_optimizer_step_quantile_balancing_moves_during_grpo_as_in_a_plain_training_step(tmp_path):
    """The recipe's `router_bias_update="optimizer_step"`: GRPO's training forwards stage their biases and the
    optimizer step applies their mean. The result equals a plain training step (forward, backward, any torch
    optimizer's step) of a fresh copy of the model on the same inputs, under TRL's defaults (bf16 autocast, gradient
    checkpointing, whose recomputed forward stages the same bias again): GRPO routes its training tokens as any other
    training step does, and the rollouts (eval mode, no grad) stage nothing."""
    inputs = []
    before, after = grpo_step_biases(tmp_path, seed=0, training_inputs=inputs, router_bias_update="optimizer_step")
    assert all(torch.count_nonzero(b) == 0 for b in before.values()) and inputs
    assert all(torch.count_nonzero(after[n]) > 0 for n in after), "every MoE layer's bias moves in a GRPO step"
    tokenizer = grpo_example().load_processing_class()
    model = tiny_model(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, router_bias_update="optimizer_step")
    model.train()
    for args, kwargs in inputs:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # GRPOConfig's default bf16=True: Trainer's autocast
            output = model(*args, **kwargs)  # TRL asks for the fused head's per-token outputs (`loss`), not logits
        (output.loss if output.logits is None else output.logits).float().sum().backward()
        assert all(torch.equal(b, before[n]) for n, b in router_biases(model).items()), "biases wait for the step"
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    plain = router_biases(model)
    assert all(torch.equal(after[n], plain[n]) for n in after), max((after[n] - plain[n]).abs().max() for n in after)


def test_agentic_recipe_runs_the_tool_loop_and_trains(tmp_path):
    """examples/grpo_agentic.py end to end on a tiny model: a short cold start on one demonstration teaches the
    tool-call format; in the GRPO step TRL parses the calls through the chat template's response template, the
    environment runs them, the process reward sees them, gradients flow, and the saved model reloads."""
    example = grpo_example()
    config = example.RecipeConfig(
        scale_down=True, num_tasks=1, max_steps=1, num_generations=4, per_device_batch_size=4,
        max_completion_length=64, max_tool_calling_iterations=1, learning_rate=1e-3, temperature=0.3,
        output_dir=str(tmp_path),
    )  # fmt: skip
    tokenizer = example.load_processing_class()
    model = example.build_model(config, tokenizer)
    example.cold_start(model, tokenizer, example.make_tasks(1), steps=40, learning_rate=1e-2, batch_size=1)
    trainer = example.build_trainer(config, model=model, tokenizer=tokenizer)
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] > 0 and log["rewards/process_reward/mean"] > 0, log
    assert log["grad_norm"] > 0 or log["reward_std"] == 0, log
    reloaded = example.save_and_reload(trainer, str(tmp_path / "final"))
    probe = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():  # equal weights at other addresses, where CPU GEMMs may round differently: fp32 rounding
        assert rel(reloaded(probe).logits, trainer.model.eval()(probe).logits) < 1e-5


def test_agentic_recipe_with_lora_saves_an_adapter_that_reloads_offline(tmp_path, monkeypatch):
    """The recipe with `lora=True` on a model built in the run: LoRA on the projections and on the routed experts'
    fused weights, the router in `modules_to_save`. The base is saved beside the adapter and named by its
    `base_model_name_or_path`, so `AutoPeftModelForCausalLM` reloads base + adapter without the Hub and computes the
    trained model's logits. The rollouts run on the static cache (`cache_implementation="static"`)."""
    example = grpo_example()
    config = example.RecipeConfig(
        scale_down=True, lora=True, num_tasks=2, max_steps=1, num_generations=2, per_device_batch_size=2,
        max_completion_length=12, max_tool_calling_iterations=1, output_dir=str(tmp_path), cache_implementation="static",
    )  # fmt: skip
    trainer = example.build_trainer(config)
    from kda_moe import KdaMoeStaticCache

    caches = []
    init = KdaMoeStaticCache.__init__
    monkeypatch.setattr(KdaMoeStaticCache, "__init__", lambda self, *a, **k: caches.append(self) or init(self, *a, **k))
    trainer.train()
    assert caches, "the rollouts run on KdaMoeStaticCache"
    model = trainer.model
    experts = [n for n, _ in model.named_parameters() if ".mlp.experts." in n and "lora_B" in n]
    assert experts and all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    routers = {n: b for n, b in model.named_buffers() if n.endswith("modules_to_save.default.e_score_correction_bias")}
    assert routers and all(torch.count_nonzero(b) > 0 for b in routers.values()), "the trained router's bias moved"
    with torch.no_grad():  # LoRA B starts at zero: random values make every adapter, the experts' included, count
        generator = torch.Generator().manual_seed(0)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    reloaded = example.save_and_reload(trainer, str(tmp_path / "final")).eval()
    saved = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    probe = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        trained = model.eval()(probe).logits
        with model.disable_adapter():
            base = model(probe).logits
        assert rel(reloaded(probe).logits, trained) < 1e-5  # equal weights at other addresses: fp32 rounding
        assert rel(base, trained) > 1e-2
