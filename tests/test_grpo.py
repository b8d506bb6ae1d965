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
