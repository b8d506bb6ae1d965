"""Parallel layouts on 2 CPU processes (gloo, `torch.multiprocessing` spawn) against one process on the same batch.

- FSDP2: `torch.distributed.fsdp.fully_shard` on every decoder layer and the root, with activation checkpointing,
  each rank holding half of the batch.
- TP: `from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`: KDA and MLA heads, dense MLP and shared
  experts split over both ranks, which hold the same batch.
- EP: experts placed over both ranks, which hold the same batch; tokens reach the experts by all-to-all from
  transformers 5.19 (`DistributedConfig(ep_size=2, tp_plan={})`), by masked routes and an all-reduce before
  (`DistributedConfig(tp_size=2, enable_expert_parallel=True)`).
- FSDP x EP (5.19+): `DistributedConfig(fsdp_size=2, ep_size=2)`, each rank holding half of the batch.

Every layout gives the single-process loss and gradients after one forward / backward. Quantile Balancing biases are
identical on every rank; where the ranks hold the same tokens (TP, EP) they pool nothing and equal the single-process
biases, where they hold different ones (FSDP) the pooled-histogram estimate equals them within its bin error. After
one optimizer step, the second step's loss equals the single-process one.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_config

WORLD_SIZE = 2
VOCAB_SIZE = 98  # transformers 5.17 wants the gathered lm_head output to split evenly


def has_token_dispatch():
    """transformers 5.19+ (`transformers.distributed.expert_parallel`) sends tokens to the experts' ranks."""
    return importlib.util.find_spec("transformers.distributed.expert_parallel") is not None


def layouts():
    """Layout name -> (DistributedConfig arguments or None for `fully_shard`, whether the ranks split the batch)."""
    expert_parallel = dict(ep_size=2, tp_plan={}) if has_token_dispatch() else dict(tp_size=2, enable_expert_parallel=True)
    chosen = {"fsdp2": (None, True), "tp": (dict(tp_size=2), False), "ep": (expert_parallel, False)}
    if has_token_dispatch():
        chosen["fsdp_x_ep"] = (dict(fsdp_size=2, ep_size=2), True)
    return chosen


def batch(step):
    return torch.randint(1, VOCAB_SIZE, (2 * WORLD_SIZE, 10), generator=torch.Generator().manual_seed(300 + step))


def full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def biases(model):
    return {name: b.clone() for name, b in model.named_buffers() if name.endswith("correction_bias")}


def load(folder, distributed):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if distributed is None:  # FSDP2 by hand: every decoder layer, then the root (embeddings, tied head, norms)
        from torch.distributed.fsdp import fully_shard

        model = AutoModelForCausalLM.from_pretrained(folder)
        model.gradient_checkpointing_enable()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(**distributed))


def run_two_steps(model, rows):
    """Two SGD steps on `rows` of each batch; the loss and gradients of the first, the loss of the second and the
    biases after each."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {}
    for step in range(2):
        input_ids = batch(step)[rows]
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        result[f"loss{step}"] = loss.detach().clone()
        result[f"biases{step}"] = biases(model)
        if step == 0:
            result["grads"] = {name: full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return result


def worker(rank, tmpdir):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/store", rank=rank, world_size=WORLD_SIZE)
    try:
        import kda_moe  # noqa: F401  (registers the Auto classes)

        results = {}
        for name, (distributed, splits_batch) in layouts().items():
            rows = slice(rank * 2, rank * 2 + 2) if splits_batch else slice(None)
            results[name] = run_two_steps(load(f"{tmpdir}/model", distributed), rows)
        torch.save(results, f"{tmpdir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from kda_moe import KdaMoeForCausalLM

    tmpdir = tmp_path_factory.mktemp("layouts")
    torch.manual_seed(0)
    KdaMoeForCausalLM(tiny_config(vocab_size=VOCAB_SIZE)).save_pretrained(tmpdir / "model")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(str(tmpdir),), nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(tmpdir / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    reference = run_two_steps(KdaMoeForCausalLM.from_pretrained(tmpdir / "model"), slice(None))
    return ranks, reference


def bin_error(bias):
    """What the pooled histogram may cost (see test_data_parallel_balancing.py): twice its bin width."""
    return 2 * (2 + 4 * bias.abs().max().item()) / tiny_config().router_balancing_bins


@pytest.mark.parametrize("layout", list(layouts()))
def test_layout_gives_the_single_process_loss_and_gradients(runs, layout):
    ranks, reference = runs
    splits_batch = layouts()[layout][1]
    loss = sum(r[layout]["loss0"] for r in ranks) / WORLD_SIZE if splits_batch else ranks[0][layout]["loss0"]
    torch.testing.assert_close(loss, reference["loss0"], rtol=1e-5, atol=0)
    for run in ranks:
        grads = run[layout]["grads"]
        assert grads.keys() == reference["grads"].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("layout", list(layouts()))
def test_balancing_biases_are_identical_on_every_rank_and_match_one_process(runs, layout):
    ranks, reference = runs
    splits_batch = layouts()[layout][1]
    for step in range(2):
        first, second = (run[layout][f"biases{step}"] for run in ranks)
        assert first.keys() == reference[f"biases{step}"].keys() and len(first) == 4
        for name, bias in first.items():
            assert torch.count_nonzero(bias) > 0 and torch.equal(bias, second[name]), name
            if not splits_batch:  # the same tokens on every rank: nothing pooled, the exact quantiles
                torch.testing.assert_close(bias, reference[f"biases{step}"][name], rtol=1e-5, atol=1e-6)
    if splits_batch:  # pooled histograms: the first step starts from the same biases as the reference
        for name, bias in ranks[0][layout]["biases0"].items():
            exact = reference["biases0"][name]
            assert (bias - exact).abs().max().item() <= bin_error(exact), name


@pytest.mark.parametrize("layout", [name for name, (_, splits_batch) in layouts().items() if not splits_batch])
def test_second_step_after_an_optimizer_step_matches_one_process(runs, layout):
    ranks, reference = runs
    for run in ranks:
        torch.testing.assert_close(run[layout]["loss1"], reference["loss1"], rtol=1e-5, atol=0)


def test_accelerate_fsdp2_config_shards_every_decoder_layer():
    from accelerate.commands.config.config_args import load_config_from_file

    from kda_moe import KdaMoeForCausalLM

    path = Path(__file__).resolve().parents[1] / "examples" / "accelerate_fsdp2.yaml"
    config = load_config_from_file(str(path))
    fsdp = config.fsdp_config
    assert config.distributed_type == "FSDP" and fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] in KdaMoeForCausalLM._no_split_modules
    assert fsdp["fsdp_activation_checkpointing"] and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert config.mixed_precision == "bf16"
