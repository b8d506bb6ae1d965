"""Context parallelism on CPU: 2 and 4 gloo processes (`torch.multiprocessing` spawn), each holding an equal slice
of the same rows of a hybrid model (KDA, MLA with RoPE, KDA, MLA; AttnRes, LatentMoE with Quantile Balancing), in
fp64, MLA in one attention block per slice on 2 ranks and in blocks of 3 tokens on 4. Every rank checks its logits
against its slice of a one-process run, the summed loss and the summed parameter gradients against that run's, and
that every rank holds the same expert biases after the step. Rows: two plain rows, and packed rows whose documents
start inside a slice (within the short conv's reach of the next slice), exactly at a slice edge, and run across two
and three slices; on 2 ranks the packed rows come from `ContextParallelCollator` (the documents as separate
examples), one of them 31 tokens long and padded to 32. On one process: the KDA slice math on both backends, MLA's blockwise attention against one masked
softmax, and the memory of an MLA step under context parallelism, linear in the sequence length."""

import copy
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from conftest import tiny_config
from gloo_testing import gloo_rank, spawn_gloo_ranks

from kda_moe.kernels.backend import TRITON_AVAILABLE
from kda_moe.kernels.kda import kimi_delta_attention

ROW_LENGTH = 32
# documents of one packed row (lengths); None: two plain rows
ROWS = {
    "plain rows": None,
    # starts at 3 and 14: 14 lies in the short conv's history (13..15) of the slice that starts at 16, which
    # continues that document (on 4 ranks it runs across three slices)
    "document start inside a slice": [3, 11, 18],
    # starts at 5, 16 (a slice edge for 2 and 4 ranks) and 21 (inside a slice)
    "document start at a slice edge": [5, 11, 5, 11],
}


@pytest.mark.parametrize(
    "backend, packed",
    [
        ("torch", False),
        ("torch", True),
        pytest.param("triton", True, marks=pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed")),
    ],
)
def test_slices_continued_from_composed_transitions_equal_one_pass(backend, packed):
    """One sequence cut into 3 slices of 16 tokens, each run from a zero state (`slice_transition`), continued from
    the composition of the earlier slices' transitions: the outputs and every input's gradient of one pass. Packed:
    documents start inside the first slice (10) and at the third slice's edge (32)."""
    from kda_moe.distributed.context_parallel import continue_from, incoming_states, slice_transition

    dtype = torch.float64 if backend == "torch" else torch.float32
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 48, 2, 16)] * 4 + [(1, 48, 2), (2,), (32,)]  # q, k, v, g, beta [B, T, H(, K)]; A_log [H]; dt_bias
    leaves = [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]
    options = dict(gate_lower_bound=-5.0, backend=backend)
    boundaries = [0, 10, 32, 48] if packed else [0, 48]
    whole = torch.tensor(boundaries) if packed else None
    per_slice = {0: ([0, 10, 16], False), 1: ([0, 16], True), 2: ([0, 16], False)} if packed else None

    summaries = []
    for index in range(3):
        cut = [t[:, 16 * index : 16 * (index + 1)] for t in leaves[:5]]
        cu_seqlens, continues = per_slice[index] if packed else (None, index > 0)
        cu_seqlens = None if cu_seqlens is None else torch.tensor(cu_seqlens)
        summaries.append(slice_transition(*cut, *leaves[5:], continues=continues, cu_seqlens=cu_seqlens, **options))
    incoming = incoming_states(torch.stack([transition for *_, transition in summaries]))
    output = torch.cat([continue_from(o, q, s) for (o, q, _), s in zip(summaries, incoming)], dim=1)
    cotangent = torch.randn_like(output)
    grads = torch.autograd.grad((output * cotangent).sum(), leaves)

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    expected = kimi_delta_attention(*ref_leaves, cu_seqlens=whole, gate_lower_bound=-5.0, backend="torch")[0]
    expected_grads = torch.autograd.grad((expected * cotangent.double()).sum(), ref_leaves)
    # against the fp64 reference: the torch path in fp64; the kernels in fp32, whose gate gradient rounds its score
    # operands to tf32 (tests/test_triton_interpret.py holds it to fp32 precision with tf32x3 launches)
    output_tolerance, grad_tolerance = (1e-10, 1e-8) if backend == "torch" else (1e-5, 5e-3)
    assert rel(output, expected) < output_tolerance
    for name, grad, expected_grad in zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias"), grads, expected_grads):
        assert rel(grad, expected_grad) < grad_tolerance, name


@pytest.mark.parametrize("key_heads", [1, 3])
def test_blockwise_attention_equals_one_masked_softmax(key_heads):
    """Queries of global tokens 11..28 over keys 0..28 in blocks of 3 x 3 (several key blocks per query block),
    documents starting inside blocks (4, 14, 23) and at a block edge (26), keys with one head shared by the 3 query
    heads or one per head: the output and the gradients of one masked softmax over all keys, in fp64."""
    from kda_moe.distributed.context_parallel import blockwise_attention

    generator = torch.Generator().manual_seed(0)
    start, length = 11, 29
    documents = torch.tensor([[0] * 4 + [1] * 10 + [2] * 9 + [3] * 3 + [4] * 3])  # [1, 29]
    query = torch.randn(1, 3, length - start, 5, generator=generator, dtype=torch.float64).requires_grad_()
    key = torch.randn(1, key_heads, length, 5, generator=generator, dtype=torch.float64).requires_grad_()
    value = torch.randn(1, key_heads, length, 4, generator=generator, dtype=torch.float64).requires_grad_()
    output = blockwise_attention(query, key, value, documents, start, scaling=0.3, block_size=3)

    queries, keys = torch.arange(start, length), torch.arange(length)
    allowed = (keys <= queries[:, None]) & (documents[0, queries, None] == documents[0, keys])  # [T, S]
    scores = (query @ key.mT * 0.3).masked_fill(~allowed, float("-inf"))
    expected = (scores.softmax(-1) @ value).transpose(1, 2)  # [1, T, 3, 4]
    cotangent = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((output * cotangent).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), (query, key, value))
    assert rel(output, expected) < 1e-12
    for name, grad, expected_grad in zip(("query", "key", "value"), grads, expected_grads):
        assert rel(grad, expected_grad) < 1e-12, name


class PeakMemory(TorchDispatchMode):
    """The most bytes that tensors produced inside the block held at once: every new storage an op returns counts
    until it is freed (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages = set()

    def _freed(self, key, nbytes):
        self.storages.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor) and id(storage := tensor.untyped_storage()) not in self.storages:
                self.storages.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return result


@pytest.fixture
def one_rank_group(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_context_parallel_mla_step_memory_grows_linearly_with_the_sequence(one_rank_group):
    """The peak memory of a forward and backward of a one-MLA-layer model under context parallelism (one rank, blocks
    of 64) grows about 4x from 256 to 1024 tokens (linear), where the one-process eager step, which builds [T, T]
    scores, grows far more (quadratic)."""
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.distributed import context_parallel

    def peak(model, length):
        input_ids = torch.randint(1, 97, (1, length), generator=torch.Generator().manual_seed(length))
        with PeakMemory() as memory:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        model.zero_grad()
        return memory.peak

    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=1, layer_types=["full_attention"], attn_implementation="eager")
    model = KdaMoeForCausalLM(config).train()
    dense_growth = peak(model, 1024) / peak(model, 256)
    context_parallel(model, one_rank_group, block_size=64)
    blockwise_growth = peak(model, 1024) / peak(model, 256)
    assert blockwise_growth < 5, blockwise_growth
    assert dense_growth > 8, dense_growth  # the measure tells quadratic from linear


def test_context_parallel_mla_refuses_attention_dropout_in_training(one_rank_group):
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.distributed import context_parallel

    config = tiny_config(num_hidden_layers=1, layer_types=["full_attention"], attention_dropout=0.1)
    model = context_parallel(KdaMoeForCausalLM(config), one_rank_group)
    input_ids = torch.ones(1, 8, dtype=torch.long)
    model.eval()(input_ids=input_ids)  # no dropout outside training
    with pytest.raises(ValueError, match="runs MLA without attention dropout"):
        model.train()(input_ids=input_ids)


def rel(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


def hybrid_config():
    return tiny_config(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mla_use_nope=False,  # RoPE at the global positions
        attn_res_block_size=2,
        router_balancing="quantile",
        experts_implementation="eager",  # grouped_mm takes no fp64
    )


def row_inputs(documents, vocab_size):
    generator = torch.Generator().manual_seed(len(documents or ()))
    if documents is None:
        input_ids = torch.randint(1, vocab_size, (2, ROW_LENGTH), generator=generator)
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    input_ids = torch.randint(1, vocab_size, (1, sum(documents)), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in documents])[None]
    labels = input_ids.masked_fill(position_ids == 0, -100)  # as DataCollatorWithFlattening: no target across documents
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def collated_inputs(mesh_or_group, batch, documents, pad_token_id=None):
    """This rank's inputs from `ContextParallelCollator` (around `DataCollatorWithFlattening`) given the documents of
    a packed row as separate examples."""
    from kda_moe.distributed import ContextParallelCollator

    pieces = batch["input_ids"][0].split(documents)
    collator = ContextParallelCollator(mesh_or_group, pad_token_id=pad_token_id)
    return collator([{"input_ids": piece.tolist()} for piece in pieces])


def check_context_parallel(model, reference, group, label, mesh_or_group=None):
    """Every row of ROWS on `group` against the one-process run of `reference` (same weights, loaded here). With
    `mesh_or_group` (which names `group`), the packed rows come from `ContextParallelCollator`, whose inputs equal
    `shard_batch`'s, and a packed row of 31 tokens comes padded to 32."""
    from kda_moe.distributed import shard_batch

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    rows = dict(ROWS)
    if mesh_or_group is not None:
        rows["collator, 31 tokens padded"] = [3, 11, 17]
    for index, (name, documents) in enumerate(rows.items()):
        name = f"{label}, {name}"
        # the loss alternately from the logits and chunk by chunk from the head's input (`linear_cross_entropy`)
        model.config.fused_linear_cross_entropy = reference.config.fused_linear_cross_entropy = index % 2 == 1
        batch = row_inputs(documents, model.config.vocab_size)
        reference.load_state_dict(model.state_dict())  # the same weights and expert biases
        expected = reference(**batch)
        expected.loss.backward()

        if mesh_or_group is None or documents is None:
            inputs = shard_batch(batch, group)
        elif sum(documents) % world_size:
            inputs = collated_inputs(mesh_or_group, batch, documents, pad_token_id=0)
            assert inputs["input_ids"].shape[-1] * world_size == sum(documents) + 1, name
        else:
            inputs = collated_inputs(mesh_or_group, batch, documents)
            expected_inputs = shard_batch(batch, group)
            assert inputs.keys() == expected_inputs.keys(), name
            for key, value in expected_inputs.items():
                assert torch.equal(inputs[key], value), f"{name}: {key}"
        output = model(**inputs)
        output.loss.backward()
        loss = output.loss.detach().clone()
        dist.all_reduce(loss, group=group)
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)

        length = inputs["input_ids"].shape[-1]
        assert (output.logits is None) == model.config.fused_linear_cross_entropy
        if output.logits is not None:
            own = expected.logits[:, rank * length : (rank + 1) * length]  # the padding has no expected logits
            logits = output.logits[:, : own.shape[1]]
            torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-9, msg=f"{name}: logits")
        torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=0, msg=f"{name}: loss")
        expected_grads, grads = gradients(reference), gradients(model)
        assert grads.keys() == expected_grads.keys()
        for param_name, grad in expected_grads.items():
            torch.testing.assert_close(grads[param_name], grad, rtol=1e-5, atol=1e-9, msg=f"{name}: {param_name}")
        for buffer_name, bias in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # pooled over every rank of the default group
                everywhere = [torch.empty_like(bias) for _ in range(dist.get_world_size())]
                dist.all_gather(everywhere, bias)
                assert all(torch.equal(b, bias) for b in everywhere), f"{name}: {buffer_name} differs across ranks"
                assert bias.abs().sum() > 0, f"{name}: {buffer_name} was not updated"
        model.zero_grad()
        reference.zero_grad()


def check_bad_inputs(model, group):
    """Inputs context parallelism cannot take raise a clear error on every rank (none waits in a collective)."""
    from kda_moe import KdaMoeCache
    from kda_moe.distributed import context_parallel, shard_batch

    rank = dist.get_rank(group)
    ids = torch.ones(1, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="do not split into 2 equal slices"):
        shard_batch({"input_ids": torch.ones(1, 31, dtype=torch.long)}, group)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match="keeps no cache"):
        model(input_ids=ids, use_cache=True, cache=KdaMoeCache(model.config))
    with pytest.raises(ValueError, match="the same \\[batch, tokens\\] slice on every rank"):
        model(input_ids=ids[:, : 16 - 8 * rank])
    with pytest.raises(ValueError, match="fewer than linear_conv_kernel_dim"):
        model(input_ids=ids[:, :2])
    with pytest.raises(ValueError, match="packed rows need batch size 1"):
        model(input_ids=ids.expand(2, -1), position_ids=torch.arange(16).remainder(6).expand(2, -1))
    with pytest.raises(ValueError, match="needs one named 'cp'"):
        context_parallel(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))


def check_fsdp_context_parallel(mesh):
    """FSDP2 (`fully_shard` on every decoder layer and the root) over all 4 ranks of the dp x cp mesh, context
    parallelism over its "cp" dimension, in fp32 on gloo as the README's recipe runs it: each dp group holds one row (a
    plain one, a packed one), cut into 2 slices, and each rank's loss counts cp times in the backward (FSDP averages
    the gradients over all 4 ranks; a row's slices must add up, the rows average). The loss summed over cp and
    averaged over dp, and the gradients FSDP reduces, equal one fp32 process's mean of the two rows' losses (1e-5
    relative) and its gradients (each within 1e-5 of its norm: the AttnRes pseudo-queries' gradients sum fp32 products
    over the tokens, in another order on one process, where the two rows run one after the other); every rank holds
    the same expert biases."""
    from torch.distributed.fsdp import fully_shard

    from kda_moe import KdaMoeForCausalLM
    from kda_moe.distributed import context_parallel, shard_batch

    torch.manual_seed(1)
    model = KdaMoeForCausalLM(hybrid_config()).train()
    reference = copy.deepcopy(model)
    plain = {name: tensor[:1] for name, tensor in row_inputs(None, reference.config.vocab_size).items()}
    rows = [plain, row_inputs(ROWS["document start inside a slice"], reference.config.vocab_size)]
    expected_loss = sum(reference(**row).loss for row in rows) / len(rows)
    expected_loss.backward()

    dp_size = mesh["dp"].size()
    everyone = mesh._flatten("dp_cp")  # FSDP shards over every rank: the cp ranks hold the same parameters too
    for layer in model.model.layers:
        fully_shard(layer, mesh=everyone)
    fully_shard(model, mesh=everyone)
    context_parallel(model, mesh)
    loss = model(**shard_batch(rows[mesh["dp"].get_local_rank()], mesh["cp"])).loss
    (loss * mesh["cp"].size()).backward()  # the slices' gradients add up, the rows' average
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / dp_size, expected_loss.detach(), rtol=1e-5, atol=0, msg="FSDP x CP: loss")
    expected_grads = gradients(reference)
    grads = {name: param.grad.full_tensor() for name, param in model.named_parameters() if param.grad is not None}
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm(), f"FSDP x CP: {name}"
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            everywhere = [torch.empty_like(bias) for _ in range(dist.get_world_size())]
            dist.all_gather(everywhere, bias)
            assert all(torch.equal(b, bias) for b in everywhere), f"FSDP x CP: {name} differs across ranks"
            assert bias.abs().sum() > 0, f"FSDP x CP: {name} was not updated"


def worker(rank, tmpdir):
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.distributed import context_parallel

    with gloo_rank(rank, tmpdir, 4):
        torch.manual_seed(0)
        model = KdaMoeForCausalLM(hybrid_config()).double().train()
        reference = KdaMoeForCausalLM(hybrid_config()).double().train()
        # two context-parallel groups of 2 ranks side by side (a data parallel x context parallel mesh), then one of 4
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        check_context_parallel(context_parallel(model, mesh), reference, mesh.get_group("cp"), "2 ranks", mesh)
        check_bad_inputs(model, mesh.get_group("cp"))
        check_fsdp_context_parallel(mesh)
        # MLA in blocks of 3 queries x 3 keys: several key blocks per query block, documents starting inside blocks
        model = context_parallel(model, dist.group.WORLD, block_size=3)
        check_context_parallel(model, reference, dist.group.WORLD, "4 ranks")

        context_parallel(model, None)  # back to one process: whole rows, the one-process logits
        reference.load_state_dict(model.state_dict())
        batch = row_inputs(ROWS["document start at a slice edge"], model.config.vocab_size)
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=0, atol=0)


def test_context_parallel_on_2_and_4_ranks_matches_one_process(tmp_path):
    spawn_gloo_ranks(worker, tmp_path, 4)
