"""Quantile Balancing / bias_sign: the deferred, gradient-free expert bias of the LatentMoE router."""

import copy

import pytest
import torch
from conftest import tiny_config, tiny_model

from kda_moe.modeling.modeling_kda_moe import KdaMoeRouter, expert_loads


def router_and_tokens(seed=0, tokens=128, **overrides):
    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    router = KdaMoeRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(tokens, config.hidden_size, requires_grad=True)
    return router, hidden


def train_step(router, hidden):
    _, weights, indices = router(hidden)
    (weights.sum() + 0 * hidden.sum()).backward()
    return indices


def test_quantile_update_gives_every_expert_the_target_load():
    router, hidden = router_and_tokens(tokens=128)
    router.train()
    before = expert_loads(train_step(router, hidden), router.num_experts)
    target = hidden.shape[0] * router.top_k // router.num_experts
    router.eval()
    with torch.no_grad():
        scores = router(hidden)[0].sigmoid()
        after = expert_loads(router(hidden)[2], router.num_experts)
    # Ties: tokens whose biased score sits exactly at an expert's cutoff could go either way.
    biased = scores + router.e_score_correction_bias
    kth = biased.topk(router.top_k, dim=-1).values[:, -1:]
    ties = int(((biased == kth).sum(-1) > 1).sum())
    assert (before - target).abs().max() > 1  # the batch starts out unbalanced
    assert (after - target).abs().max() <= 1 + ties, (before.tolist(), after.tolist(), target)
    assert abs(router.e_score_correction_bias.mean().item()) < 1e-6
    assert router.e_score_correction_bias.grad is None and not router.e_score_correction_bias.requires_grad


def test_bias_is_applied_only_after_backward():
    router, hidden = router_and_tokens()
    router.train()
    _, weights, _ = router(hidden)
    assert torch.count_nonzero(router.e_score_correction_bias) == 0  # staged, not applied, during the forward
    weights.sum().backward()
    assert torch.count_nonzero(router.e_score_correction_bias) > 0


def test_bias_is_unchanged_in_eval_mode_and_under_no_grad():
    router, hidden = router_and_tokens()
    router.eval()
    router(hidden)[1].sum().backward()
    assert torch.count_nonzero(router.e_score_correction_bias) == 0
    router.train()
    with torch.no_grad():
        router(hidden)
    assert torch.count_nonzero(router.e_score_correction_bias) == 0
    assert router._pending_bias is None


def test_bias_sign_moves_against_the_load():
    router, hidden = router_and_tokens(router_balancing="bias_sign", router_bias_update_rate=0.01)
    router.train()
    load = expert_loads(train_step(router, hidden), router.num_experts).float()
    expected = 0.01 * torch.sign(load.mean() - load)
    assert torch.allclose(router.e_score_correction_bias, expected)


def test_no_balancing_leaves_the_bias_alone():
    router, hidden = router_and_tokens(router_balancing="none")
    router.train()
    train_step(router, hidden)
    assert torch.count_nonzero(router.e_score_correction_bias) == 0


def test_bias_is_saved_and_restored(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(seed=0).train()
    input_ids = torch.randint(1, model.config.vocab_size, (2, 16))
    model(input_ids, labels=input_ids).loss.backward()
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert biases and all(torch.count_nonzero(b) > 0 for b in biases.values())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, buffer in reloaded.named_buffers():
        if name in biases:
            assert buffer.dtype == torch.float32 and torch.equal(buffer, biases.pop(name))
    assert not biases


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("balancing", ["quantile", "bias_sign"])
def test_gradient_checkpointing_sees_the_same_routing(balancing, reentrant):
    """Two forward + backward passes with and without gradient checkpointing: the same gradients, and the same biases
    after each backward's update (the recomputed forward stages no second update). The weights stay fixed between the
    passes, so the second pass routes with the first's biases on the same weights in both runs: an optimizer step on
    gradients that checkpointing sums in another order would round the weights apart and move the routing by that."""
    base = tiny_model(seed=3, router_balancing=balancing, router_bias_update_rate=0.05).train()
    runs = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        grads = []
        for step in range(2):
            input_ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(step))
            model(input_ids, labels=input_ids).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad()
        biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        runs.append((grads, biases))
    (grads_a, biases_a), (grads_b, biases_b) = runs
    for step_a, step_b in zip(grads_a, grads_b):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            assert torch.allclose(step_a[name], step_b[name], atol=1e-6, rtol=1e-5), name
    for name in biases_a:
        assert torch.count_nonzero(biases_a[name]) > 0
        assert torch.equal(biases_a[name], biases_b[name]), name


def test_router_load_statistics_report_every_moe_layer():
    model = tiny_model(seed=0)
    with torch.no_grad():
        model(torch.randint(1, model.config.vocab_size, (2, 10)))
    stats = model.router_load_statistics()
    sparse_layers = [i for i, kind in enumerate(model.config.mlp_layer_types) if kind == "sparse"]
    assert sorted(stats) == [f"model.layers.{i}.mlp" for i in sparse_layers]
    for layer_stats in stats.values():
        assert layer_stats["mean_load"] == pytest.approx(2 * 10 * model.config.num_experts_per_tok / model.config.num_experts)
        assert layer_stats["max_load"] >= layer_stats["mean_load"] and 0 <= layer_stats["dead_experts"] < 8


def test_histogram_quantile_is_within_one_bin_of_the_exact_order_statistic():
    from kda_moe.modeling.modeling_kda_moe import column_quantile

    values = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    width = (values.max(0).values - values.min(0).values) / 64
    for rank in (1, 37, 150, 300):
        exact = column_quantile(values, rank, bins=None, group=None)
        estimate = column_quantile(values, rank, bins=64, group=None)
        assert ((estimate - exact).abs() <= width + 1e-6).all(), rank


def test_histogram_balancing_matches_exact_balancing_closely():
    from kda_moe.modeling.modeling_kda_moe import quantile_balancing_bias

    router, hidden = router_and_tokens(tokens=256)
    with torch.no_grad():
        scores = router(hidden)[0].sigmoid()
    bias = torch.zeros(router.num_experts)
    exact = quantile_balancing_bias(scores, bias, router.top_k, iterations=8)
    estimate = quantile_balancing_bias(scores, bias, router.top_k, iterations=8, bins=4096)
    assert (exact - estimate).abs().max() < 2e-3
    loads = expert_loads((scores + estimate).topk(router.top_k, dim=-1).indices, router.num_experts)
    assert (loads - 256 * router.top_k // router.num_experts).abs().max() <= 2


def micro_batches():
    return [torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(40 + i)) for i in range(2)]


def biases(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


@pytest.mark.parametrize("balancing", ["quantile", "bias_sign"])
def test_optimizer_step_update_routes_every_micro_batch_alike_and_applies_their_mean_bias(balancing):
    """`router_bias_update="optimizer_step"` with two micro-batches of gradient accumulation: the second routes with
    the bias the first saw (its training logits equal a no-grad forward's before the step, where the per-backward
    update has moved them), and the optimizer step applies the mean of the two micro-batches' biases, each computed
    from the bias before the step as the per-backward update computes it."""
    base = tiny_model(seed=5, router_balancing=balancing, router_bias_update_rate=0.05).train()
    first, second = micro_batches()
    start = biases(base)
    per_micro_batch = []  # each micro-batch's bias from the starting bias, by the per-backward update
    for input_ids in (first, second):
        model = copy.deepcopy(base)
        model(input_ids, labels=input_ids).loss.backward()
        per_micro_batch.append(biases(model))

    for update in ("optimizer_step", "backward"):
        model = tiny_model(seed=5, router_balancing=balancing, router_bias_update_rate=0.05,
                           router_bias_update=update).train()  # the same weights as base
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            rollout_logits = model(second).logits  # what a rollout saw before the step
        model(first, labels=first).loss.backward()
        training_logits = model(second).logits  # the training forward of the second micro-batch
        training_logits.sum().backward()
        if update == "optimizer_step":
            assert torch.equal(training_logits, rollout_logits)
            assert all(torch.equal(b, start[n]) for n, b in biases(model).items())  # nothing applied before the step
            optimizer.step()
            for name, bias in biases(model).items():
                expected = (per_micro_batch[0][name] + per_micro_batch[1][name]) / 2
                assert torch.count_nonzero(bias) > 0 and torch.allclose(bias, expected, atol=1e-7), name
        else:
            assert not torch.equal(training_logits, rollout_logits)


def test_optimizer_step_update_counts_each_micro_batch_once_under_gradient_checkpointing():
    """Checkpointed layers run the router's forward again in the backward: each micro-batch still adds one bias."""
    results = []
    for checkpointing in (False, True):
        model = tiny_model(seed=6, router_bias_update="optimizer_step").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for input_ids in micro_batches():
            model(input_ids, labels=input_ids).loss.backward()
        counts = {m._accumulated_count for m in model.modules() if isinstance(m, KdaMoeRouter)}
        optimizer.step()
        results.append((counts, biases(model)))
    (counts, plain), (counts_checkpointed, checkpointed) = results
    assert counts == counts_checkpointed == {2}
    for name, bias in plain.items():
        assert torch.count_nonzero(bias) > 0 and torch.equal(bias, checkpointed[name]), name


def test_bias_update_must_be_one_of_the_two_moments():
    with pytest.raises(ValueError, match="router_bias_update"):
        tiny_config(router_bias_update="epoch")
