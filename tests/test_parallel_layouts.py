"""Parallel layouts on 2 and 4 CPU processes (gloo, `torch.multiprocessing` spawn) against one process on the same
batch.

- FSDP2: `torch.distributed.fsdp.fully_shard` on every decoder layer and the root, with activation checkpointing,
  each rank holding half of the batch.
- TP: `from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`: KDA and MLA heads, dense MLP and shared
  experts split over both ranks, which hold the same batch.
- EP: experts placed over both ranks, which hold the same batch; tokens reach the experts by all-to-all from
  transformers 5.19 (`DistributedConfig(ep_size=2, tp_plan={})`), by masked routes and an all-reduce before
  (`DistributedConfig(tp_size=2, enable_expert_parallel=True)`).
- FSDP x EP (5.19+): `DistributedConfig(fsdp_size=2, ep_size=2)`, each rank holding half of the batch.
- HSDP over 4 ranks, parameters sharded within each pair and replicated across the pairs, every rank holding a
  quarter of the batch: `DistributedConfig(dp_replicate_size=2, fsdp_size=2)` from transformers 5.18, `fully_shard`
  over a (replicate, shard) mesh by hand on 5.17.
- FSDP x TP over 4 ranks, a (fsdp 2, tp 2) mesh whose two tensor-parallel pairs each hold half of the batch:
  `DistributedConfig(fsdp_size=2, tp_size=2)` from transformers 5.18. 5.17 would lay out the tensor-parallel plan
  alone from such a config, and the package refuses it there; the layout is built as that refusal tells users to:
  `from_pretrained(..., tp_plan="auto", device_mesh=mesh)` splits over the mesh's "tp" axis, `fully_shard` shards
  over its "fsdp" axis.
- TP and FSDP (`DistributedConfig(fsdp_size=2)`) from the published Kimi Linear and Kimi K3 layouts (K3's routed
  experts mxfp4), whose KDA conv and `A_log` and vision `wqkv` are stored unlike ours: each rank ends with its part of
  the single-process parameters and gives the single-process logits; FSDP x TP from the Kimi Linear layout likewise.

Every layout gives the single-process loss and gradients after one forward / backward. Quantile Balancing pools its
statistics over the ranks that hold other parts of the batch, never over ranks that hold the same tokens, and its
biases are identical on every rank; where every rank holds the same tokens (TP, EP) they pool nothing and equal the
single-process biases, where the batch is split (FSDP) the pooled-histogram estimate equals them within its bin error.
After one optimizer step, the second step's loss equals the single-process one.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from gloo_testing import bin_error, gloo_rank, spawn_gloo_ranks
from multimodal_testing import tiny_multimodal_model

from kda_moe.compat import EXPERT_TOKEN_DISPATCH, FSDP_WITH_TENSOR_PARALLEL, HSDP_IN_DISTRIBUTED_CONFIG

BATCH_ROWS = 4
VOCAB_SIZE = 98  # transformers 5.17 wants the gathered lm_head output to split evenly
LINEAR_NUM_HEADS = 4  # `b_proj` has a row per KDA head: one for each rank of the 2 x 2 FSDP x TP mesh


class Layout(NamedTuple):
    """How a layout is built, and how its ranks share the batch."""

    load: Callable  # (model class, folder) -> the model laid out over `ranks` processes
    ranks: int
    batch_parts: int  # the data-parallel size: rank r holds part r // (ranks // batch_parts) of the batch


def with_distributed_config(**sizes):
    def load(model_class, folder):
        from transformers.distributed import DistributedConfig

        return model_class.from_pretrained(folder, distributed_config=DistributedConfig(**sizes))

    return load


def fully_shard_layers(model, mesh=None):
    """FSDP2 by hand over `mesh` (default: every rank): every decoder layer, then the root (embeddings, tied head,
    norms), with activation checkpointing."""
    from torch.distributed.fsdp import fully_shard

    model.gradient_checkpointing_enable()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2(model_class, folder):
    return fully_shard_layers(model_class.from_pretrained(folder))


def fsdp_over_tensor_parallel_by_hand(model_class, folder):
    """FSDP x TP where transformers lays out only one of them from a DistributedConfig (5.17): tensor parallelism by
    `from_pretrained` over the "tp" axis of the mesh, FSDP2 over its "fsdp" axis, balancing pooled over "fsdp"."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    model = model_class.from_pretrained(folder, tp_plan="auto", device_mesh=mesh)
    model.set_balancing_group(mesh["fsdp"].get_group())
    return fully_shard_layers(model, mesh["fsdp"])


def hsdp_by_hand(model_class, folder):
    """HSDP where a DistributedConfig has no replicate axis (5.17): FSDP2 over a (replicate, shard) mesh; every rank
    holds other tokens, so balancing pools over all of them (the default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return fully_shard_layers(model_class.from_pretrained(folder), mesh)


def layouts():
    """Layout name -> how it loads, over how many ranks, in how many parts they split the batch."""
    expert_parallel = dict(ep_size=2, tp_plan={}) if EXPERT_TOKEN_DISPATCH else dict(tp_size=2, enable_expert_parallel=True)
    chosen = {
        "fsdp2": Layout(fsdp2, ranks=2, batch_parts=2),
        "tp": Layout(with_distributed_config(tp_size=2), ranks=2, batch_parts=1),
        "ep": Layout(with_distributed_config(**expert_parallel), ranks=2, batch_parts=1),
    }
    if EXPERT_TOKEN_DISPATCH:
        chosen["fsdp_x_ep"] = Layout(with_distributed_config(fsdp_size=2, ep_size=2), ranks=2, batch_parts=2)
    if FSDP_WITH_TENSOR_PARALLEL:
        chosen["fsdp_x_tp"] = Layout(with_distributed_config(fsdp_size=2, tp_size=2), ranks=4, batch_parts=2)
    else:
        chosen["fsdp_x_tp"] = Layout(fsdp_over_tensor_parallel_by_hand, ranks=4, batch_parts=2)
    if HSDP_IN_DISTRIBUTED_CONFIG:
        chosen["hsdp"] = Layout(with_distributed_config(dp_replicate_size=2, fsdp_size=2), ranks=4, batch_parts=4)
    else:
        chosen["hsdp"] = Layout(hsdp_by_hand, ranks=4, batch_parts=4)
    return chosen


def rows(layout, rank):
    """The rows of the batch that `rank` holds."""
    part = rank // (layout.ranks // layout.batch_parts)
    size = BATCH_ROWS // layout.batch_parts
    return slice(part * size, (part + 1) * size)


def data_parallel_peers(layout, rank):
    """The ranks at `rank`'s place in each part of the batch, `rank` among them (None: every rank holds it whole)."""
    if layout.batch_parts == 1:
        return None
    ranks_per_part = layout.ranks // layout.batch_parts
    return [part * ranks_per_part + rank % ranks_per_part for part in range(layout.batch_parts)]


def batch(step):
    return torch.randint(1, VOCAB_SIZE, (BATCH_ROWS, 10), generator=torch.Generator().manual_seed(300 + step))


def full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def biases(model):
    return {name: b.clone() for name, b in model.named_buffers() if name.endswith("correction_bias")}


def balancing_ranks(model):
    """The ranks over which the routers of `model` pool their balancing statistics (all alike), or None."""
    from kda_moe.modeling.modeling_kda_moe import KdaMoeRouter, data_parallel_group

    (group,) = {data_parallel_group(m.balancing_group) for m in model.modules() if isinstance(m, KdaMoeRouter)}
    return None if group is None else dist.get_process_group_ranks(group)


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


def logits_and_parameters(model):
    """Logits of one forward on the whole batch, and every parameter whole."""
    with torch.no_grad():
        logits = model(batch(0)).logits
    return logits, {name: full(parameter) for name, parameter in model.named_parameters()}


PUBLISHED_LAYOUTS = ("kimi_linear", "kimi_k3")


def save_published_layout(folder, layout, moe_intermediate_size=64):
    """A tiny model that `layout` can express, with 4 KDA heads (2 a rank), saved in `layout`; K3's routed experts
    packed mxfp4 (32 weights a scale: expert matrices 32 wide, also each TP rank's half where
    `moe_intermediate_size` is 64)."""
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.configuration.configuration_kda_moe import KIMI_LINEAR_DEFAULTS

    torch.manual_seed(0)
    if layout == "kimi_k3":
        text = dict(linear_num_heads=4, routed_expert_hidden_size=32, moe_intermediate_size=moe_intermediate_size)
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


def layouts_worker(rank, tmpdir, world_size, folders):
    """Two steps of every layout over `world_size` ranks, and the published layouts loaded on as many ranks: with TP
    and with FSDP over 2 ranks; over 4, Kimi Linear's with FSDP x TP and, where a DistributedConfig lays that out
    (5.18+), its refusal of the model with 2 KDA heads."""
    from transformers.distributed import DistributedConfig

    from kda_moe import KdaMoeForCausalLM

    with gloo_rank(rank, tmpdir, world_size) as results:
        for name, layout in layouts().items():
            if layout.ranks == world_size:
                model = layout.load(KdaMoeForCausalLM, f"{folders}/model")
                results[name] = run_two_steps(model, rows(layout, rank)) | {"balancing_ranks": balancing_ranks(model)}
        if world_size == 2:
            for published in PUBLISHED_LAYOUTS:
                folder = f"{folders}/{published}"
                model = load_published(folder, published, distributed_config=DistributedConfig(tp_size=2))
                results[f"{published}_tp"] = logits_and_kda_tensors(model)
                model = load_published(folder, published, distributed_config=DistributedConfig(fsdp_size=2))
                results[f"{published}_fsdp"] = logits_and_parameters(model)
            results["narrow_experts_tp"] = tensor_parallel_load_report(f"{folders}/kimi_k3_narrow_experts")
        if world_size == 4:
            fsdp_x_tp = layouts()["fsdp_x_tp"].load
            model = fsdp_x_tp(KdaMoeForCausalLM, f"{folders}/kimi_linear")
            results["kimi_linear_fsdp_x_tp"] = logits_and_parameters(model)
            if FSDP_WITH_TENSOR_PARALLEL:
                try:
                    fsdp_x_tp(KdaMoeForCausalLM, f"{folders}/two_heads")
                except ValueError as refusal:
                    results["refusal"] = str(refusal)


def tensor_parallel_load_report(folder):
    """"loaded", or what transformers logged before it refused to load the K3 `folder` over 2 tensor-parallel ranks."""
    from transformers.distributed import DistributedConfig
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    refused = False
    with CaptureLogger(logging.get_logger("transformers")) as log:
        try:
            load_published(folder, "kimi_k3", distributed_config=DistributedConfig(tp_size=2))
        except RuntimeError:
            refused = True
    return log.out if refused else "loaded"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`model`, which every layout trains; `two_heads`, the same with 2 KDA heads; the published layouts, and K3's
    with experts 32 wide (one mxfp4 scale group a row)."""
    from kda_moe import KdaMoeForCausalLM

    folder = tmp_path_factory.mktemp("models")
    for name, heads in (("model", LINEAR_NUM_HEADS), ("two_heads", 2)):
        torch.manual_seed(0)
        KdaMoeForCausalLM(tiny_config(vocab_size=VOCAB_SIZE, linear_num_heads=heads)).save_pretrained(folder / name)
    for layout in PUBLISHED_LAYOUTS:
        save_published_layout(folder / layout, layout)
    save_published_layout(folder / "kimi_k3_narrow_experts", "kimi_k3", moe_intermediate_size=32)
    return folder


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    """Per world size, what each of its ranks saved (`layouts_worker`, one spawn); the single-process run."""
    from kda_moe import KdaMoeForCausalLM

    per_world = {}
    for world_size in sorted({layout.ranks for layout in layouts().values()}):
        tmpdir = tmp_path_factory.mktemp(f"{world_size}_ranks")
        per_world[world_size] = spawn_gloo_ranks(layouts_worker, tmpdir, world_size, world_size, str(folders))
    reference = run_two_steps(KdaMoeForCausalLM.from_pretrained(folders / "model"), slice(None))
    return per_world, reference


def layout_runs(runs, name):
    """The layout `name`, what each of its ranks saved for it, and the single-process run."""
    per_world, reference = runs
    layout = layouts()[name]
    return layout, [run[name] for run in per_world[layout.ranks]], reference


@pytest.mark.parametrize("name", list(layouts()))
def test_layout_gives_the_single_process_loss_and_gradients(runs, name):
    _, ranks, reference = layout_runs(runs, name)
    loss = torch.stack([run["loss0"] for run in ranks]).mean()  # every part of the batch on as many ranks
    torch.testing.assert_close(loss, reference["loss0"], rtol=1e-5, atol=0)
    for run in ranks:
        grads = run["grads"]
        assert grads.keys() == reference["grads"].keys()
        for parameter, grad in grads.items():
            torch.testing.assert_close(grad, reference["grads"][parameter], rtol=1e-5, atol=1e-7, msg=parameter)


@pytest.mark.parametrize("name", list(layouts()))
def test_balancing_pools_over_the_ranks_that_hold_other_tokens_only(runs, name):
    """Ranks of one tensor-parallel group route the same tokens: pooling over them would count each token once per
    rank. FSDP x TP pools over the "fsdp" axis ([0, 2] and [1, 3]), FSDP alone over every rank, TP and EP nowhere."""
    layout, ranks, _ = layout_runs(runs, name)
    for rank, run in enumerate(ranks):
        assert run["balancing_ranks"] == data_parallel_peers(layout, rank)


@pytest.mark.parametrize("name", list(layouts()))
def test_balancing_biases_are_identical_on_every_rank_and_match_one_process(runs, name):
    layout, ranks, reference = layout_runs(runs, name)
    for step in range(2):
        first, *others = (run[f"biases{step}"] for run in ranks)
        assert first.keys() == reference[f"biases{step}"].keys() and len(first) == 4
        for bias_name, bias in first.items():
            assert torch.count_nonzero(bias) > 0, bias_name
            assert all(torch.equal(bias, other[bias_name]) for other in others), bias_name
            if layout.batch_parts == 1:  # the same tokens on every rank: nothing pooled, the exact quantiles
                torch.testing.assert_close(bias, reference[f"biases{step}"][bias_name], rtol=1e-5, atol=1e-6)
    if layout.batch_parts > 1:  # pooled histograms: the first step starts from the same biases as the reference
        for bias_name, bias in ranks[0]["biases0"].items():
            exact = reference["biases0"][bias_name]
            assert (bias - exact).abs().max().item() <= bin_error(exact, tiny_config()), bias_name


@pytest.mark.parametrize("name", [name for name, layout in layouts().items() if layout.batch_parts == 1])
def test_second_step_after_an_optimizer_step_matches_one_process(runs, name):
    _, ranks, reference = layout_runs(runs, name)
    for run in ranks:
        torch.testing.assert_close(run["loss1"], reference["loss1"], rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def published_layout_runs(runs, folders):
    """Per layout loaded with TP (`{layout}_tp`) and with FSDP (`{layout}_fsdp`): what each of 2 ranks saw, what one
    process saw, all loaded from the same folder."""
    single = {}
    for layout in PUBLISHED_LAYOUTS:
        model = load_published(folders / layout, layout)
        single[f"{layout}_tp"] = logits_and_kda_tensors(model)
        single[f"{layout}_fsdp"] = logits_and_parameters(model)
    per_world, _ = runs
    return per_world[2], single


@pytest.mark.parametrize("layout", PUBLISHED_LAYOUTS)
def test_tensor_parallel_load_of_a_published_layout_runs_each_rank_on_its_own_heads(published_layout_runs, layout):
    ranks, single = published_layout_runs
    logits, whole = single[f"{layout}_tp"]
    assert len(whole["A_log"]) == len(whole["conv"]) == 3  # the KDA layers
    for rank, run in enumerate(ranks):
        rank_logits, local = run[f"{layout}_tp"]
        for name, tensors in whole.items():
            for layer, tensor in enumerate(tensors):
                blocks = 3 if name == "conv" else 1  # the conv weight is q | k | v, each split by head
                expected = tensor.view(blocks, len(ranks), -1, *tensor.shape[1:])[:, rank].flatten(0, 1)
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


def test_fsdp_x_tp_load_of_the_published_kimi_linear_layout_gives_every_rank_the_single_process_parameters(
    runs, published_layout_runs
):
    per_world, _ = runs
    _, single = published_layout_runs
    logits, parameters = single["kimi_linear_fsdp"]
    for run in per_world[4]:
        rank_logits, rank_parameters = run["kimi_linear_fsdp_x_tp"]
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


@pytest.mark.skipif(
    not FSDP_WITH_TENSOR_PARALLEL,
    reason="transformers 5.17 lays out FSDP x TP by hand only: fully_shard after a tensor-parallel load, no FSDP shard "
    "for its loader to read",
)
def test_fsdp_x_tp_that_leaves_a_rank_no_row_of_a_parameter_is_refused_with_the_sizes_that_work(runs):
    """`b_proj` has a row per KDA head: 2 heads give each tensor-parallel rank 1 row, none for one of its 2 FSDP ranks,
    which transformers' loader cannot read."""
    per_world, _ = runs
    for run in per_world[4]:
        assert "refusal" in run, "FSDP x TP of 2 KDA heads over a 2 x 2 mesh loaded"
        expected = r"ranks \[2, 3\] without any row of `model\.layers\.0\.self_attn\.b_proj\.weight`.*product divides 2"
        assert re.search(expected, run["refusal"]) and "dp_replicate_size" in run["refusal"]


@pytest.mark.skipif(
    FSDP_WITH_TENSOR_PARALLEL, reason="transformers 5.18+ lays out FSDP x TP from one DistributedConfig (fsdp_x_tp)"
)
def test_fsdp_with_tensor_parallel_in_one_distributed_config_is_refused_on_transformers_5_17():
    """5.17 would apply the tensor-parallel plan alone, over the first tp_size ranks."""
    from transformers.distributed import DistributedConfig

    from kda_moe import KdaMoeForCausalLM

    model = KdaMoeForCausalLM(tiny_config())
    fix = r"tp_size=2, fsdp_size=2.*transformers >= 5\.18.*device_mesh=mesh.*set_balancing_group"
    with pytest.raises(ValueError, match=fix):
        KdaMoeForCausalLM.maybe_distribute_model(model, DistributedConfig(tp_size=2, fsdp_size=2), None)


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


def test_tensor_parallel_split_of_mxfp4_experts_inside_their_scale_groups_is_refused_with_the_fix(runs):
    """K3 experts 32 wide over 2 tensor-parallel ranks: up to transformers 5.18 the plan splits `down_proj`'s 32 input
    features into 16 a rank, half an mxfp4 scale group, and the load stops with what to change; from 5.19 every expert
    stays whole and it loads."""
    per_world, _ = runs
    reports = [run["narrow_experts_tp"] for run in per_world[2]]
    if EXPERT_TOKEN_DISPATCH:
        assert reports == ["loaded", "loaded"]
        return
    for report in reports:
        assert "down_proj` splits its 32 input features over 2 ranks (16 a rank)" in report, report[-3000:]
        assert "one scale per 32 weights" in report and "enable_expert_parallel=True" in report
