"""Quantile Balancing under data parallelism: 2 CPU processes (gloo, `torch.multiprocessing` spawn), each holding
half of every batch. Both ranks end every step with identical expert biases, equal to a single-process run on the
pooled batch within the pooled-histogram estimator's bin error, and a checkpoint saved by rank 0 reloads on one
process. DDP runs with `broadcast_buffers=False`, so agreement comes from the router's own pooling, not from DDP
copying rank 0's buffers."""

import pytest
import torch
from conftest import tiny_config, tiny_model
from gloo_testing import bin_error, gloo_rank, spawn_gloo_ranks

WORLD_SIZE = 2
STEPS = 3
TOKENS_PER_RANK = 96


def pooled_hidden(step, hidden_size):
    return torch.randn(WORLD_SIZE * TOKENS_PER_RANK, hidden_size, generator=torch.Generator().manual_seed(100 + step))


def pooled_input_ids(step, vocab_size):
    return torch.randint(1, vocab_size, (2 * WORLD_SIZE, 12), generator=torch.Generator().manual_seed(200 + step))


def new_router(seed=0):
    from kda_moe.modeling.modeling_kda_moe import KdaMoeRouter

    torch.manual_seed(seed)
    router = KdaMoeRouter(tiny_config())
    torch.nn.init.normal_(router.weight, std=0.5)
    return router.train()


def router_step(router, hidden):
    hidden = hidden.clone().requires_grad_(True)
    _, weights, _ = router(hidden)
    weights.sum().backward()  # the bias computed in the forward is applied once the backward reaches the router


def worker(rank, tmpdir):
    with gloo_rank(rank, tmpdir, WORLD_SIZE) as results:
        results.update(router=[], model=[])
        # 1. The router alone, the same weights on both ranks, each rank routing its half of the pooled tokens.
        router = new_router()
        for step in range(STEPS):
            before = router.e_score_correction_bias.clone()
            router_step(router, pooled_hidden(step, router.weight.shape[1]).chunk(WORLD_SIZE)[rank])
            results["router"].append((before, router.e_score_correction_bias.clone()))

        # 2. The whole model under DDP: SGD steps on each rank's half of the pooled batch.
        model = tiny_model(seed=0).train()
        # Every parameter gets a gradient (test below), so DDP needs no unused-parameter search.
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(STEPS):
            input_ids = pooled_input_ids(step, model.config.vocab_size).chunk(WORLD_SIZE)[rank]
            ddp(input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            results["model"].append({n: b.clone() for n, b in model.named_buffers() if n.endswith("correction_bias")})
        model.eval()
        model.save_pretrained(f"{tmpdir}/checkpoint", is_main_process=rank == 0)
        with torch.no_grad():
            results["logits"] = model(pooled_input_ids(0, model.config.vocab_size)).logits


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmpdir = tmp_path_factory.mktemp("dp")
    return tmpdir, spawn_gloo_ranks(worker, tmpdir, WORLD_SIZE)


def test_both_ranks_end_every_step_with_identical_biases(ranks):
    _, (rank0, rank1) = ranks
    for (_, a), (_, b) in zip(rank0["router"], rank1["router"]):
        assert torch.count_nonzero(a) > 0 and torch.equal(a, b)
    for a, b in zip(rank0["model"], rank1["model"]):
        assert a.keys() == b.keys() and len(a) == tiny_config().mlp_layer_types.count("sparse")
        for name in a:
            assert torch.count_nonzero(a[name]) > 0 and torch.equal(a[name], b[name]), name


def test_biases_equal_a_single_process_run_on_the_pooled_batch(ranks):
    from kda_moe.modeling.modeling_kda_moe import expert_loads

    _, (rank0, _) = ranks
    config = tiny_config()
    # Router: every step, one process routing all the pooled tokens from the same starting bias.
    for step, (before, after) in enumerate(rank0["router"]):
        reference = new_router()
        reference.e_score_correction_bias.copy_(before)
        hidden = pooled_hidden(step, reference.weight.shape[1])
        router_step(reference, hidden)
        exact = reference.e_score_correction_bias
        assert (after - exact).abs().max().item() <= bin_error(exact, config), (step, after, exact)
        # ... and the pooled bias balances the pooled batch like the exact one does.
        with torch.no_grad():
            reference.eval()
            reference.e_score_correction_bias.copy_(after)
            load = expert_loads(reference(hidden)[2], reference.num_experts)
        target = hidden.shape[0] * reference.top_k / reference.num_experts
        assert (load - target).abs().max() <= 0.1 * target + 2, (step, load.tolist(), target)

    # Whole model, first step (every layer routes the same tokens with the same weights in both runs).
    model = tiny_model(seed=0).train()
    input_ids = pooled_input_ids(0, model.config.vocab_size)
    model(input_ids, labels=input_ids).loss.backward()
    for name, bias in model.named_buffers():
        if name.endswith("correction_bias"):
            distributed = rank0["model"][0][name]
            assert (distributed - bias).abs().max().item() <= bin_error(bias, config), name


def test_checkpoint_saved_by_rank_0_reloads_on_one_process(ranks):
    from transformers import AutoModelForCausalLM

    tmpdir, (rank0, _) = ranks
    reloaded = AutoModelForCausalLM.from_pretrained(tmpdir / "checkpoint").eval()
    final = rank0["model"][-1]
    for name, buffer in reloaded.named_buffers():
        if name in final:
            assert torch.equal(buffer, final[name]), name
    with torch.no_grad():
        logits = reloaded(pooled_input_ids(0, reloaded.config.vocab_size)).logits
    torch.testing.assert_close(logits, rank0["logits"], rtol=1e-5, atol=1e-6)  # 1 vs 2 CPU threads
    assert (tmpdir / "checkpoint" / "README.md").exists()  # the model card, written by the main process only


def test_every_parameter_gets_a_gradient_so_ddp_needs_no_unused_parameter_search():
    model = tiny_model(seed=0).train()
    input_ids = pooled_input_ids(0, model.config.vocab_size)
    model(input_ids, labels=input_ids).loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
