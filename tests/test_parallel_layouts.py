"""Parallel layouts on 2 CPU processes (gloo, `torch.multiprocessing` spawn) against one process on the same batch.

- FSDP2: `torch.distributed.fsdp.fully_shard` on every decoder layer and the root, with activation checkpointing,
  each rank holding half of the batch.
- TP: `from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`: KDA and MLA heads, dense MLP and shared
  experts split over both ranks, which hold the same batch.
- EP: experts placed over both ranks, which hold the same batch; tokens reach the experts by all-to-all from
  transformers 5.19 (`DistributedConfig(ep_size=2, tp_plan={})`), by masked routes and an all-reduce before
  (`DistributedConfig(tp_size=2, enable_expert_parallel=True)`).
- FSDP x EP (5.19+): `DistributedConfig(fsdp_size=2, ep_size=2)`, each rank holding half of the batch.
- TP and FSDP (`DistributedConfig(fsdp_size=2)`) from the published Kimi Linear and Kimi K3 layouts (K3's routed
  experts mxfp4), whose KDA conv and `A_log` and vision `wqkv` are stored unlike ours: each rank ends with its part of
  the single-process parameters and gives the single-process logits.

Every layout gives the single-process loss and gradients after one forward / backward. Quantile Balancing biases are
identical on every rank; where the ranks hold the same tokens (TP, EP) they pool nothing and equal the single-process
biases, where they hold different ones (FSDP) the pooled-histogram estimate equals them within its bin error. After
one optimizer step, the second step's loss equals the single-process one.
"""

import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_config
from multimodal_testing import tiny_multimodal_model

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


@contextmanager
def gloo_rank(rank, tmpdir):
    """This process as rank `rank` of a gloo group of WORLD_SIZE (torchrun's environment variables set); yields the
    dict of results that is saved to `tmpdir/rank{rank}.pt` once every rank is done."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/store", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {}
        yield results
        torch.save(results, f"{tmpdir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def worker(rank, tmpdir):
    with gloo_rank(rank, tmpdir) as results:
        import kda_moe  # noqa: F401  (registers the Auto classes)

        for name, (distributed, splits_batch) in layouts().items():
            rows = slice(rank * 2, rank * 2 + 2) if splits_batch else slice(None)
            results[name] = run_two_steps(load(f"{tmpdir}/model", distributed), rows)


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


PUBLISHED_LAYOUTS = ("kimi_linear", "kimi_k3")


def save_published_layout(folder, layout):
    """A tiny model that `layout` can express, with 4 KDA heads (2 a rank), saved in `layout`; K3's routed experts
    packed mxfp4 (32 weights a scale: expert matrices 32 wide, also each TP rank's half)."""
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.configuration.configuration_kda_moe import KIMI_LINEAR_DEFAULTS

    torch.manual_seed(0)
    if layout == "kimi_k3":
        text = dict(linear_num_heads=4, routed_expert_hidden_size=32, moe_intermediate_size=64)
        tiny_multimodal_model(text_config=text).save_pretrained(folder, layout=layout, quantize_experts="mxfp4")
        return
    model = KdaMoeForCausalLM(tiny_config(vocab_size=VOCAB_SIZE, linear_num_heads=4, **KIMI_LINEAR_DEFAULTS))
    model.save_pretrained(folder, layout=layout)


def load_published(folder, layout, **kwargs):
    from kda_moe import KdaMoeForCausalLM, KdaMoeForConditionalGeneration

    model_class = KdaMoeForConditionalGeneration if layout == "kimi_k3" else KdaMoeForCausalLM
    return model_class.from_pretrained(folder, **kwargs)


def logits_and_kda_tensors(model):
    """Logits of one forward, and the `A_log`, `dt_bias` and conv weight every KDA layer ran with, in layer order."""
    from kda_moe.modeling import modeling_kda_moe

    seen = {"A_log": [], "dt_bias": [], "conv": []}
    delta_rule, conv = modeling_kda_moe.kimi_delta_attention, modeling_kda_moe.short_conv

    def recording_delta_rule(query, key, value, gate, beta, A_log, dt_bias, **kwargs):
        seen["A_log"].append(A_log.detach().clone())
        seen["dt_bias"].append(dt_bias.detach().clone())
        return delta_rule(query, key, value, gate, beta, A_log, dt_bias, **kwargs)

    def recording_conv(inputs, weight, **kwargs):
        seen["conv"].append(weight.detach().clone())
        return conv(inputs, weight, **kwargs)

    with (
        mock.patch.object(modeling_kda_moe, "kimi_delta_attention", recording_delta_rule),
        mock.patch.object(modeling_kda_moe, "short_conv", recording_conv),
        torch.no_grad(),
    ):
        logits = model(batch(0)).logits
    return logits, seen


def published_layout_worker(rank, tmpdir):
    from transformers.distributed import DistributedConfig

    with gloo_rank(rank, tmpdir) as results:
        for layout in PUBLISHED_LAYOUTS:
            model = load_published(f"{tmpdir}/{layout}", layout, distributed_config=DistributedConfig(tp_size=2))
            results[layout] = logits_and_kda_tensors(model)
            model = load_published(f"{tmpdir}/{layout}", layout, distributed_config=DistributedConfig(fsdp_size=2))
            parameters = {name: full(parameter) for name, parameter in model.named_parameters()}
            results[f"{layout}_fsdp"] = logits_and_kda_tensors(model)[0], parameters


@pytest.fixture(scope="module")
def published_layout_runs(tmp_path_factory):
    """Per layout, and per layout loaded with FSDP (`{layout}_fsdp`): what each of 2 ranks saw, what one process saw,
    all loaded from the same folder."""
    tmpdir = tmp_path_factory.mktemp("published_layouts")
    for layout in PUBLISHED_LAYOUTS:
        save_published_layout(tmpdir / layout, layout)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(published_layout_worker, args=(str(tmpdir),), nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(tmpdir / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    single = {}
    for layout in PUBLISHED_LAYOUTS:
        model = load_published(tmpdir / layout, layout)
        single[layout] = logits_and_kda_tensors(model)
        single[f"{layout}_fsdp"] = single[layout][0], {name: p.detach() for name, p in model.named_parameters()}
    return ranks, single


@pytest.mark.parametrize("layout", PUBLISHED_LAYOUTS)
def test_tensor_parallel_load_of_a_published_layout_runs_each_rank_on_its_own_heads(published_layout_runs, layout):
    ranks, single = published_layout_runs
    logits, whole = single[layout]
    assert len(whole["A_log"]) == len(whole["conv"]) == 3  # the KDA layers
    for rank, run in enumerate(ranks):
        rank_logits, local = run[layout]
        for name, tensors in whole.items():
            for layer, tensor in enumerate(tensors):
                blocks = 3 if name == "conv" else 1  # the conv weight is q | k | v, each split by head
                expected = tensor.view(blocks, WORLD_SIZE, -1, *tensor.shape[1:])[:, rank].flatten(0, 1)
                torch.testing.assert_close(local[name][layer], expected, rtol=0, atol=0, msg=f"{name} {layer}")
        torch.testing.assert_close(rank_logits, logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", PUBLISHED_LAYOUTS)
def test_fsdp_load_of_a_published_layout_gives_every_rank_the_single_process_parameters(published_layout_runs, layout):
    """transformers cuts each checkpoint tensor to the rank's FSDP shard before the conversions run; those that merge,
    split or trim tensors (the q | k | v conv, `A_log`, the vision `wqkv`) must still give each rank its shard of
    the converted parameter."""
    ranks, single = published_layout_runs
    logits, parameters = single[f"{layout}_fsdp"]
    for run in ranks:
        rank_logits, rank_parameters = run[f"{layout}_fsdp"]
        assert rank_parameters.keys() == parameters.keys()
        for name, parameter in rank_parameters.items():
            torch.testing.assert_close(parameter, parameters[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(rank_logits, logits, rtol=1e-5, atol=1e-6)


def test_published_layout_conversion_into_a_strided_shard_is_refused_with_the_fix():
    """A conversion that needs whole checkpoint tensors can undo the loader's contiguous `Shard` cuts, not the
    interleaved ones of a `_StridedShard`: it refuses and names the conversion to run first."""
    from types import SimpleNamespace

    from torch.distributed.tensor.placement_types import _StridedShard

    from kda_moe.distributed.sharded_loading import whole_checkpoint_tensor

    interleaved = [_StridedShard(0, split_factor=2)]  # what FSDP over a tensor-parallel split can place
    parameter = SimpleNamespace(device_mesh=SimpleNamespace(ndim=1), placements=interleaved, ndim=2)
    with pytest.raises(ValueError, match=r"_StridedShard.*save_pretrained\(converted, layout='kda_moe'\)"):
        whole_checkpoint_tensor(torch.zeros(4, 2), parameter)


def test_tensor_parallel_size_that_does_not_divide_the_kda_heads_is_refused():
    from types import SimpleNamespace

    from kda_moe import KdaMoeForCausalLM
    from kda_moe.distributed.tensor_parallel import KdaHeadsParallel

    attention = KdaMoeForCausalLM(tiny_config(linear_num_heads=3)).model.layers[0].self_attn
    two_ranks = SimpleNamespace(size=lambda: 2)
    with pytest.raises(ValueError, match="over 2 ranks .* linear_num_heads=3"):
        KdaHeadsParallel().install_forward(attention, two_ranks)


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
