"""Training across several processes: the tensor-parallel styles KDA needs in transformers' TP / EP plans
(`tensor_parallel`) and context parallelism, one long sequence split across ranks (`context_parallel`)."""

from .context_parallel import (
    ContextParallel,
    ContextParallelCollator,
    SequenceShard,
    context_parallel,
    gather_from_ranks,
    shard_batch,
)

__all__ = [
    "ContextParallel",
    "ContextParallelCollator",
    "SequenceShard",
    "context_parallel",
    "gather_from_ranks",
    "shard_batch",
]
