"""Context parallelism on CPU: 2 and 4 gloo processes (`torch.multiprocessing` spawn), each holding an equal slice
of the same rows of a hybrid model (KDA, MLA with RoPE, KDA, MLA; AttnRes, LatentMoE with Quantile Balancing), in
fp64. Every rank checks its logits against its slice of a one-process run, the summed loss and the summed parameter
gradients against that run's, and that every rank holds the same expert biases after the step. Rows: two plain rows,
and packed rows whose documents start inside a slice (within the short conv's reach of the next slice), exactly at
a slice edge, and run across two and three slices."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_config

ROW_LENGTH = 48
# documents of one packed row (lengths); None: two plain rows
ROWS = {
    "plain rows": None,
    # starts at 3 and 22: 22 lies in the conv history of the slice after it (2 ranks: 21..23 | 24..; 4 ranks: the
    # third slice), whose first document then began on an earlier rank
    "document start inside a slice": [3, 19, 26],
    # starts at 5, 24 (a slice edge for 2 and 4 ranks) and 33 (inside a slice)
    "document start at a slice edge": [5, 19, 9, 15],
}


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
    assert sum(documents) == ROW_LENGTH
    input_ids = torch.randint(1, vocab_size, (1, ROW_LENGTH), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in documents])[None]
    labels = input_ids.masked_fill(position_ids == 0, -100)  # as DataCollatorWithFlattening: no target across documents
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def worker(rank, world_size, tmpdir):
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.distributed import context_parallel, shard_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/store", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = KdaMoeForCausalLM(hybrid_config()).double().train()
        reference = KdaMoeForCausalLM(hybrid_config()).double().train()
        context_parallel(model, dist.group.WORLD)
        for name, documents in ROWS.items():
            batch = row_inputs(documents, model.config.vocab_size)
            reference.load_state_dict(model.state_dict())  # the same weights and expert biases
            expected = reference(**batch)
            expected.loss.backward()

            shard = shard_batch(batch, dist.group.WORLD)
            output = model(**shard)
            output.loss.backward()
            loss = output.loss.detach().clone()
            dist.all_reduce(loss)
            for param in model.parameters():
                dist.all_reduce(param.grad)

            length = ROW_LENGTH // world_size
            own = expected.logits[:, rank * length : (rank + 1) * length]
            torch.testing.assert_close(output.logits, own, rtol=1e-5, atol=1e-9, msg=f"{name}: logits")
            torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=0, msg=f"{name}: loss")
            expected_grads, grads = gradients(reference), gradients(model)
            assert grads.keys() == expected_grads.keys()
            for param_name, grad in expected_grads.items():
                torch.testing.assert_close(grads[param_name], grad, rtol=1e-5, atol=1e-9, msg=f"{name}: {param_name}")
            for buffer_name, bias in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    everywhere = [torch.empty_like(bias) for _ in range(world_size)]
                    dist.all_gather(everywhere, bias)
                    assert all(torch.equal(b, bias) for b in everywhere), f"{name}: {buffer_name} differs across ranks"
                    assert bias.abs().sum() > 0, f"{name}: {buffer_name} was not updated"
            model.zero_grad()
            reference.zero_grad()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_matches_one_process(world_size, tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(world_size, str(tmp_path)), nprocs=world_size, join=True)
