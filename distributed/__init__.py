"""Training across several processes: context parallelism (one long sequence split across ranks)."""

from .context_parallel import ContextParallel, SequenceShard, context_parallel, gather_from_ranks, shard_batch

__all__ = ["ContextParallel", "SequenceShard", "context_parallel", "gather_from_ranks", "shard_batch"]
