"""Multi-process tests on CPU: gloo ranks started by `torch.multiprocessing`, each handing its results back to the
test through a file."""

import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextmanager
def gloo_rank(rank, tmpdir, world_size):
    """This process as rank `rank` of a gloo group of `world_size` (torchrun's environment variables set); yields
    the dict of results that is saved to `tmpdir/rank{rank}.pt` once every rank is done."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/store", rank=rank, world_size=world_size)
    try:
        results = {}
        yield results
        torch.save(results, f"{tmpdir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo_ranks(worker, tmpdir, world_size, *args):
    """`worker(rank, tmpdir, *args)` on `world_size` new processes (each one `gloo_rank` inside); returns what each
    rank saved, in rank order. A rank that fails fails the call."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(str(tmpdir), *args), nprocs=world_size, join=True)
    return [torch.load(Path(tmpdir) / f"rank{rank}.pt") for rank in range(world_size)]


def bin_error(bias, config):
    """What the pooled histogram of Quantile Balancing may cost: its bin width, twice. Each pass reads the quantile
    within one bin (`column_quantile`), and the damped passes (`QUANTILE_STEP`) keep the accumulated error at about one
    bin. Margins `s - cutoff` span at most 2 + 4 max|b| (sigmoid scores in (0, 1), cutoffs shifted by the biases)."""
    return 2 * (2 + 4 * bias.abs().max().item()) / config.router_balancing_bins
