"""accelerate's own FSDP2 path on 2 CPU processes (gloo), as `examples/accelerate_fsdp2.yaml` configures it: its
activation checkpointing (`fsdp2_apply_ac`, torch's `checkpoint_wrapper` around every decoder layer) and sharding
(`fsdp2_prepare_model`) with bf16 parameters and an fp32 gradient reduce. A training forward that does not pass
`use_cache` trains (the recomputed layers write no cache), with no decoder layer returning a view (which FSDP2 warns
of), and gives the loss and gradients of one process computing in bf16 on the whole batch; Quantile Balancing biases are identical on every rank. The sharded checkpoint accelerate
writes (`save_fsdp_model`, what Trainer saves for `SHARDED_STATE_DICT`) merges with `merge_fsdp_weights` into a
safetensors file that `from_pretrained` loads, with the model's `config.json` beside it, as the trained model."""

import types
import warnings

import pytest
import torch
from conftest import tiny_config
from gloo_testing import bin_error, gloo_rank, spawn_gloo_ranks
from test_parallel_layouts import full

WORLD_SIZE = 2
ROWS = 2  # a rank


def batch(step):
    return torch.randint(1, 97, (WORLD_SIZE * ROWS, 12), generator=torch.Generator().manual_seed(700 + step))


def unwrapped(name):
    """A parameter or buffer name without the checkpoint wrapper's module, as the model's state dict names it."""
    return name.replace("_checkpoint_wrapped_module.", "")


def biases(model):
    return {unwrapped(name): b.clone() for name, b in model.named_buffers() if name.endswith("correction_bias")}


def train(model, rows):
    """Two SGD steps on `rows` of each batch, `use_cache` left unset: the losses, the first step's gradients and the
    biases after the second."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {"losses": []}
    for step in range(2):
        input_ids = batch(step)[rows]
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        result["losses"].append(loss.detach().float())
        if step == 0:
            result["grads"] = {unwrapped(name): full(p.grad).float() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    result["biases"] = biases(model)
    return result


def worker(rank, tmpdir):
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    from kda_moe import KdaMoeForCausalLM

    with gloo_rank(rank, tmpdir, WORLD_SIZE) as results:
        PartialState()  # accelerate's process state over the gloo group (its logging needs it)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["KdaMoeDecoderLayer"],
            activation_checkpointing=True,
            reshard_after_forward=True,
            mixed_precision_policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
            state_dict_type="SHARDED_STATE_DICT",
        )
        # what accelerate's `Accelerator.prepare` hands these helpers on a single-node FSDP2 run
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, parallelism_config=None,
            mixed_precision="bf16", is_main_process=rank == 0, device=torch.device("cpu"), process_index=rank,
            num_processes=WORLD_SIZE,
        )  # fmt: skip
        model = KdaMoeForCausalLM.from_pretrained(f"{tmpdir}/model").train()
        model = fsdp2_prepare_model(accelerator, fsdp2_apply_ac(accelerator, model))
        results["wrapped"] = [hasattr(layer, "_checkpoint_wrapped_module") for layer in model.model.layers]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results |= train(model, slice(rank * ROWS, (rank + 1) * ROWS))
        results["view_warnings"] = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
        save_fsdp_model(plugin, accelerator, model, f"{tmpdir}/checkpoint-2")
        if rank == 0:
            model.config.save_pretrained(f"{tmpdir}/export")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from kda_moe import KdaMoeForCausalLM

    tmpdir = tmp_path_factory.mktemp("accelerate_fsdp2")
    torch.manual_seed(0)
    KdaMoeForCausalLM(tiny_config()).save_pretrained(tmpdir / "model")
    ranks = spawn_gloo_ranks(worker, tmpdir, WORLD_SIZE)
    # one process on the whole batch, computing in bf16 like FSDP's parameter dtype
    reference = KdaMoeForCausalLM.from_pretrained(tmpdir / "model").to(torch.bfloat16).train()
    return tmpdir, ranks, train(reference, slice(None))


def test_activation_checkpointed_fsdp2_gives_the_single_process_loss_and_gradients(runs):
    _, ranks, reference = runs
    assert all(all(results["wrapped"]) for results in ranks)
    assert [results["view_warnings"] for results in ranks] == [[], []]
    for step in range(2):  # each rank's loss is the mean over its rows; their mean is the whole batch's
        mean = sum(results["losses"][step] for results in ranks) / WORLD_SIZE
        torch.testing.assert_close(mean, reference["losses"][step], rtol=1e-2, atol=0)
    grads = ranks[0]["grads"]
    assert grads.keys() == reference["grads"].keys()
    for name, grad in grads.items():
        expected = reference["grads"][name]
        # bf16 tolerance: the reference rounds each gradient to bf16 once over the whole batch, the ranks round their
        # halves to bf16 and sum them in fp32, so elements differ by a few bf16 ulps of the largest of the tensor
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item(), msg=name)
        assert torch.equal(ranks[1]["grads"][name], grad), name


def test_balancing_biases_are_identical_on_every_rank(runs):
    _, ranks, reference = runs
    biases = ranks[0]["biases"]
    assert biases and all(bias.abs().sum() > 0 for bias in biases.values())
    for name, bias in biases.items():
        assert torch.equal(ranks[1]["biases"][name], bias), name
        expected = reference["biases"][name].float()
        torch.testing.assert_close(bias.float(), expected, rtol=0, atol=bin_error(expected, tiny_config()), msg=name)


def test_merged_sharded_checkpoint_loads_with_from_pretrained_as_the_trained_model(runs):
    from accelerate.state import PartialState
    from accelerate.utils import merge_fsdp_weights

    from kda_moe import KdaMoeForCausalLM

    tmpdir, ranks, _ = runs
    try:
        merge_fsdp_weights(str(tmpdir / "checkpoint-2" / "pytorch_model_fsdp_0"), str(tmpdir / "export"))
    finally:
        PartialState._reset_state()
    loaded = KdaMoeForCausalLM.from_pretrained(tmpdir / "export")
    untrained = KdaMoeForCausalLM.from_pretrained(tmpdir / "model")
    assert loaded.dtype == torch.float32  # FSDP keeps the sharded parameters in fp32; bf16 is the compute copy
    state, before = loaded.state_dict(), untrained.state_dict()
    assert not torch.equal(state["model.norm.weight"], before["model.norm.weight"])  # it is the trained model
    for name, bias in ranks[0]["biases"].items():
        assert torch.equal(state[name], bias), name
    input_ids = batch(0)
    with torch.no_grad():
        assert torch.isfinite(loaded(input_ids, labels=input_ids).loss)


def test_training_forward_builds_a_cache_only_when_asked_and_refuses_one_under_checkpoint_wrapped_layers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from kda_moe import KdaMoeForCausalLM
    from kda_moe.compat import output_cache

    torch.manual_seed(0)
    model = KdaMoeForCausalLM(tiny_config()).train()
    input_ids = batch(0)[:1, :6]
    assert output_cache(model(input_ids)) is None  # config.use_cache is the inference default
    assert output_cache(model(input_ids, use_cache=True)) is not None
    with torch.no_grad():
        assert output_cache(model(input_ids)) is not None
    assert output_cache(model.eval()(input_ids)) is not None
    model.train()
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = checkpoint_wrapper(layer)
    model(input_ids, labels=input_ids).loss.backward()
    with pytest.raises(ValueError, match="checkpoint_wrapper"):
        model(input_ids, use_cache=True)
