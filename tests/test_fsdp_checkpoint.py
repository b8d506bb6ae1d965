"""FSDP2 checkpoints on 2 CPU processes (gloo): a sharded checkpoint (torch.distributed.checkpoint, what accelerate and
Trainer write for `SHARDED_STATE_DICT`) of the model and its AdamW state, saved after a training step and loaded into a
freshly sharded model, continues training exactly like the run that never stopped (loss, parameters and Quantile
Balancing biases); the consolidated full state dict, saved by rank 0 with `save_pretrained`, loads with
`from_pretrained` as the trained parameters and biases."""

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from gloo_testing import gloo_rank, spawn_gloo_ranks

WORLD_SIZE = 2


def batch(step, rank):
    ids = torch.randint(1, 97, (2 * WORLD_SIZE, 12), generator=torch.Generator().manual_seed(500 + step))
    return ids[2 * rank : 2 * rank + 2]


def sharded(folder):
    """The saved model with every decoder layer and the root `fully_shard`-ed, and its AdamW optimizer."""
    from torch.distributed.fsdp import fully_shard

    from kda_moe import KdaMoeForCausalLM

    model = KdaMoeForCausalLM.from_pretrained(folder).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step):
    input_ids = batch(step, dist.get_rank())
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach().clone()


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def worker(rank, tmpdir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from kda_moe import KdaMoeForCausalLM

    with gloo_rank(rank, tmpdir, WORLD_SIZE) as results:
        model, optimizer = sharded(f"{tmpdir}/model")
        train_step(model, optimizer, 0)
        model_state, optimizer_state = get_state_dict(model, optimizer)  # sharded: each rank writes its shards
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"{tmpdir}/sharded")
        results["uninterrupted"] = [train_step(model, optimizer, step) for step in (1, 2)]
        results["uninterrupted_state"] = full_state(model)

        resumed, resumed_optimizer = sharded(f"{tmpdir}/model")  # the untrained weights, until the load
        model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
        checkpoint = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(checkpoint, checkpoint_id=f"{tmpdir}/sharded")
        set_state_dict(resumed, resumed_optimizer, model_state_dict=checkpoint["model"],
                       optim_state_dict=checkpoint["optimizer"])  # fmt: skip
        results["resumed"] = [train_step(resumed, resumed_optimizer, step) for step in (1, 2)]
        results["resumed_state"] = state = full_state(resumed)  # on rank 0 (gathered to its CPU), else empty
        results["biases"] = {n: b.clone() for n, b in resumed.named_buffers() if n.endswith("e_score_correction_bias")}

        if rank == 0:  # one consolidated folder, written from the gathered state
            with torch.device("meta"):
                export = KdaMoeForCausalLM(resumed.config)
            export.load_state_dict(state, assign=True)
            export.save_pretrained(f"{tmpdir}/consolidated")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from kda_moe import KdaMoeForCausalLM

    tmpdir = tmp_path_factory.mktemp("fsdp_checkpoint")
    torch.manual_seed(0)
    KdaMoeForCausalLM(tiny_config()).save_pretrained(tmpdir / "model")
    return tmpdir, spawn_gloo_ranks(worker, tmpdir, WORLD_SIZE)


def test_resumed_sharded_checkpoint_trains_exactly_like_the_run_that_never_stopped(runs):
    _, ranks = runs
    for results in ranks:
        assert torch.equal(torch.stack(results["resumed"]), torch.stack(results["uninterrupted"]))
    state, uninterrupted = ranks[0]["resumed_state"], ranks[0]["uninterrupted_state"]
    assert state.keys() == uninterrupted.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, uninterrupted[name]), name
    biases = ranks[0]["biases"]
    assert biases and all(bias.abs().sum() > 0 for bias in biases.values())  # balancing moved them
    for name, bias in biases.items():  # identical on every rank, and those of the gathered state
        assert torch.equal(ranks[1]["biases"][name], bias) and torch.equal(state[name], bias), name


def test_consolidated_export_loads_with_from_pretrained_as_the_trained_model(runs):
    from kda_moe import KdaMoeForCausalLM

    tmpdir, ranks = runs
    loaded = KdaMoeForCausalLM.from_pretrained(tmpdir / "consolidated")
    trained = ranks[0]["resumed_state"]
    state = loaded.state_dict()
    assert set(trained) <= set(state)
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    untrained = KdaMoeForCausalLM.from_pretrained(tmpdir / "model").state_dict()
    assert not torch.equal(state["model.norm.weight"], untrained["model.norm.weight"])  # it is the trained model
