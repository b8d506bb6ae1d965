"""Context parallelism: one long sequence split into equal contiguous slices across the ranks of a process group.

    model = context_parallel(model, group)          # or a DeviceMesh (its "cp" dimension, or a 1-D mesh)
    inputs = shard_batch(batch, group)              # this rank's slice of input_ids / position_ids / labels
                                                    # (or ContextParallelCollator(group) in place of the collator)
    loss = model(**inputs).loss                     # this rank's share: the global loss is the sum over ranks
    loss.backward()                                 # then sum the parameter gradients over the group

What each part of the model needs from the other ranks, and how it gets it (with the matching backward):
- KDA: the state its first token continues from. Every rank runs its slice from a zero state and also computes the
  slice's affine state transition; the ranks all-gather the transitions (K x (K + V) per head), compose them up to
  their own slice and correct their outputs exactly (`slice_transition` has the math).
- The short conv before KDA: the previous rank's last `kernel - 1` conv inputs (all-gathered tails).
- MLA: the keys of every earlier token. The ranks all-gather the compressed latent and the rope key
  (`kv_lora_rank + qk_rope_head_dim` values per token) and attend block by block (`blockwise_attention`): no mask
  over all keys is ever built, so memory grows linearly with the sequence length.
- Block AttnRes, the MLPs and the experts are token-local. Quantile Balancing already pools its statistics over every
  rank of the default process group, which holds the context-parallel group.

Packed rows (one row of several documents, position ids restarting at 0 at each document) work as on one process:
a document start inside a slice or exactly at a slice edge cuts the KDA state, the conv history and MLA attention.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..kernels.kda import kimi_delta_attention

BLOCK_SIZE = 1024  # MLA's query and key blocks: its scores are [B, H, BLOCK_SIZE, BLOCK_SIZE] at a time


class _GatherFromRanks(torch.autograd.Function):
    """Every rank's `tensor` stacked [world, *tensor.shape]; the backward sums the gradients the ranks computed for a
    rank's slice and hands it to that rank."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        gathered = tensor.new_empty(dist.get_world_size(group), *tensor.shape)
        dist.all_gather(list(gathered.unbind(0)), tensor.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            own = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(own, grad, group=ctx.group)
            return own, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather_from_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """[*shape] on every rank -> [world, *shape], differentiable (the gradient goes back to the rank it came from)."""
    return _GatherFromRanks.apply(tensor, group)


class _BlockAttention(torch.autograd.Function):
    """Causal attention of one query block over the keys it can see, key block by key block with an online softmax
    (running max and sum in fp32 or wider); the backward recomputes each block's probabilities from the saved
    log-sum-exp, so only [B, H, block, block] scores exist at a time and nothing quadratic is kept for the backward
    (checkpointing each block instead would keep every block's running [B, H, Q, Dv] output as its input: one per key
    block, quadratic again).

    query [B, H, Q, D] of global tokens query_start.., key [B, Hk, S, D] and value [B, Hk, S, Dv] of global tokens
    key_start.. (Hk = 1: one key head shared by every query head, or Hk = H), query_documents [B, Q] and
    key_documents [B, S] the document of each token -> [B, H, Q, Dv]. A query sees the keys at or before its own
    global index in its own document."""

    @staticmethod
    def forward(ctx, query, key, value, query_documents, key_documents, query_start, key_start, scaling, block_size):
        accumulate = torch.promote_types(query.dtype, torch.float32)
        shape = query.shape[:-1] + (1,)
        row_max = query.new_full(shape, float("-inf"), dtype=accumulate)
        row_sum = query.new_zeros(shape, dtype=accumulate)
        output = query.new_zeros(query.shape[:-1] + value.shape[-1:], dtype=accumulate)  # [B, H, Q, Dv]
        for block, scores in _block_scores(query, key, query_documents, key_documents, query_start, key_start,
                                           scaling, block_size):  # fmt: skip
            block_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
            shift = block_max.masked_fill(block_max == float("-inf"), 0.0)  # rows that see no key yet
            probs = torch.exp(scores - shift)
            rescale = torch.exp(row_max - shift)
            row_sum = row_sum * rescale + probs.sum(-1, keepdim=True)
            output = output * rescale + probs @ value[:, :, block].to(accumulate)
            row_max = block_max
        output = (output / row_sum).to(query.dtype)
        log_sum_exp = row_max + row_sum.log()  # [B, H, Q, 1]
        ctx.save_for_backward(query, key, value, query_documents, key_documents, output, log_sum_exp)
        ctx.positions = (query_start, key_start, scaling, block_size)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, query_documents, key_documents, output, log_sum_exp = ctx.saved_tensors
        query_start, key_start, scaling, block_size = ctx.positions
        accumulate = log_sum_exp.dtype
        grad_output = grad_output.to(accumulate)
        # d loss / d score = p * (d loss / d p - sum_k p_k d loss / d p_k), the sum being rowsum(dO * O)
        output_dot = (grad_output * output.to(accumulate)).sum(-1, keepdim=True)  # [B, H, Q, 1]
        grad_query = torch.zeros_like(query, dtype=accumulate)
        grad_key = torch.zeros_like(key, dtype=accumulate)
        grad_value = torch.zeros_like(value, dtype=accumulate)
        for block, scores in _block_scores(query, key, query_documents, key_documents, query_start, key_start,
                                           scaling, block_size):  # fmt: skip
            probs = torch.exp(scores - log_sum_exp)  # [B, H, Q, block], 0 where masked
            grad_value[:, :, block] += _sum_to_heads(probs.mT @ grad_output, value.shape[1])
            grad_scores = probs * (grad_output @ value[:, :, block].to(accumulate).mT - output_dot) * scaling
            grad_query += grad_scores @ key[:, :, block].to(accumulate)
            grad_key[:, :, block] += _sum_to_heads(grad_scores.mT @ query.to(accumulate), key.shape[1])
        grads = (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype))
        return *grads, None, None, None, None, None, None


def _block_scores(query, key, query_documents, key_documents, query_start, key_start, scaling, block_size):
    """(key block as a slice, scaled scores [B, H, Q, block] in fp32 or wider, -inf where the query may not look) for
    each key block in order."""
    accumulate = torch.promote_types(query.dtype, torch.float32)
    query_index = torch.arange(query_start, query_start + query.shape[2], device=query.device)
    query = query.to(accumulate)
    for first in range(0, key.shape[2], block_size):
        block = slice(first, min(first + block_size, key.shape[2]))
        key_index = torch.arange(key_start + block.start, key_start + block.stop, device=key.device)
        causal = key_index[None, :] <= query_index[:, None]  # [Q, block]
        same_document = query_documents[:, :, None] == key_documents[:, None, block]  # [B, Q, block]
        allowed = (causal & same_document)[:, None]  # [B, 1, Q, block]
        scores = (query @ key[:, :, block].to(accumulate).mT) * scaling
        yield block, scores.masked_fill(~allowed, float("-inf"))


def _sum_to_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient [B, H, ...] summed over the query heads when the keys / values have one head shared by all."""
    return grad.sum(1, keepdim=True) if heads == 1 else grad


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sequence_ids: torch.Tensor,
    query_start: int,
    scaling: float,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Causal attention of the queries of global tokens query_start.. over the keys of global tokens 0.., within
    documents, in blocks of `block_size` queries x `block_size` keys: the [queries x keys] mask and scores are never
    built whole, and the backward recomputes each block (`_BlockAttention`), so memory is linear in the lengths.

    query [B, H, T, D], key [B, Hk, S, D], value [B, Hk, S, Dv] (Hk = 1 or H), sequence_ids [B, >= S] the document of
    every global token (non-decreasing along a row) -> [B, T, H, Dv]. A query block reads only the key blocks from the
    start of its first query's document up to its last query: none after it (causal), none of an earlier document.
    """
    documents = sequence_ids.contiguous()
    outputs = []
    for first in range(0, query.shape[2], block_size):
        last = min(first + block_size, query.shape[2])
        begin, end = query_start + first, query_start + last  # the block's global token indices
        # the start of the block's first document: the first token of the row with that document id
        first_key = int(torch.searchsorted(documents, documents[:, begin : begin + 1].contiguous()).min())
        visible = slice(first_key, end)
        outputs.append(
            _BlockAttention.apply(
                query[:, :, first:last], key[:, :, visible], value[:, :, visible], sequence_ids[:, begin:end],
                sequence_ids[:, visible], begin, first_key, scaling, block_size,
            )  # fmt: skip
        )
    return torch.cat(outputs, dim=2).transpose(1, 2)


@dataclass(frozen=True)
class SequenceShard:
    """This rank's slice of the row(s) of one forward, and what its layers need to join the other slices.

    rank: the place in the context-parallel `group`; start: the slice's first global token index (every
    slice holds the same number of tokens); position_ids [B, T]: the slice's global position ids (RoPE);
    sequence_ids [B, world * T]: the document every global token belongs to (all 0 unless the row is packed);
    cu_seqlens [N + 1]: the local document boundaries of a packed row (else None), the first local document possibly
    the continuation of the previous rank's last one; continues: whether the slice's first token continues the
    previous rank's document.
    """

    group: "dist.ProcessGroup"
    rank: int
    start: int
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    continues: bool
    block_size: int = BLOCK_SIZE

    @property
    def end(self) -> int:
        return self.start + self.position_ids.shape[1]

    def attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, dropout: float = 0.0
    ) -> torch.Tensor:
        """MLA's attention of this slice's queries [B, H, T, D] over the keys [B, Hk, end, D] and values
        [B, Hk, end, Dv] of every global token up to the slice's end (`gather_keys`), within documents, block by
        block (`blockwise_attention`) -> [B, T, H, Dv]."""
        if dropout > 0:
            raise ValueError(
                f"context parallelism runs MLA without attention dropout, got attention_dropout={dropout} in "
                "training: set config.attention_dropout = 0.0."
            )
        return blockwise_attention(query, key, value, self.sequence_ids, self.start, scaling, self.block_size)

    def gather_keys(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's compressed keys of every global token before this slice's end.

        latent [B, 1, T, kv_lora], k_rope [B, 1, T, rope] (already rotated at the global positions) ->
        [B, 1, end, kv_lora], [B, 1, end, rope]; one all-gather of both."""
        keys = gather_from_ranks(torch.cat([latent, k_rope], dim=-1), self.group)  # [world, B, 1, T, kv_lora + rope]
        keys = keys.movedim(0, 2).flatten(2, 3)[:, :, : self.end]  # [B, 1, end, kv_lora + rope]
        return keys.split([latent.shape[-1], k_rope.shape[-1]], dim=-1)

    def conv_history(self, conv_inputs: torch.Tensor, kernel_size: int) -> torch.Tensor | None:
        """The short conv's initial state: the previous rank's last `kernel_size - 1` conv inputs, zero where they
        belong to another document than this slice's first token (always on rank 0).

        conv_inputs [B, T, C] -> [B, C, W - 1], or [N, C, W - 1] for a packed row (zeros for the documents that
        start inside the slice)."""
        width = kernel_size - 1
        if width == 0:
            return None
        tails = gather_from_ranks(conv_inputs[:, conv_inputs.shape[1] - width :], self.group)  # [world, B, W-1, C]
        history = tails[self.rank - 1]  # rank 0 reads the last rank's tail, masked out below
        indices = torch.arange(self.start - width, self.start, device=history.device)
        same_document = self.sequence_ids[:, indices.clamp_min(0)] == self.sequence_ids[:, self.start, None]
        history = history.masked_fill(~(same_document & (indices >= 0))[..., None], 0.0).mT  # [B, C, W-1]
        if self.cu_seqlens is not None:
            later = history.new_zeros(len(self.cu_seqlens) - 2, *history.shape[1:])
            history = torch.cat([history, later])
        return history

    def delta_rule(self, *kda_inputs: torch.Tensor, gate_lower_bound: float | None, backend: str) -> torch.Tensor:
        """`kimi_delta_attention` over this slice as if it continued from every earlier slice: kda_inputs are its
        (q, k, v, g, beta, A_log, dt_bias); returns o [B, T, H, V]. See `slice_transition` for the math.

        Every rank composes all the transitions (world - 1 small matmuls) and picks its own incoming state, so that
        each rank's graph reaches the all-gather and every rank joins its backward (rank 0 included)."""
        output, carried_query, transition = slice_transition(
            *kda_inputs, continues=self.continues, cu_seqlens=self.cu_seqlens, gate_lower_bound=gate_lower_bound,
            backend=backend,
        )  # fmt: skip
        incoming = incoming_states(gather_from_ranks(transition, self.group))[self.rank]
        return continue_from(output, carried_query, incoming)


def slice_transition(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    continues: bool,
    cu_seqlens: torch.Tensor | None = None,
    gate_lower_bound: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KDA over one slice of a longer sequence, from a zero state, with what it needs to continue any incoming state.

    Arguments as `kimi_delta_attention` (cu_seqlens: the slice's document boundaries, its first document the
    continuation of the previous slice's when `continues`). Returns (output [B, T, H, V] from a zero incoming state,
    carried_query [B, T, H, K], transition [B, H, K, V + K] = [D | M] of the slice's last document).

    The math. Per token the gated delta rule is affine in the state S [K, V]:
        S_t = A_t S_{t-1} + b_t,   A_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) [K, K],   b_t = beta_t k_t v_t^T.
    Over the slice, S_t = M_t S_in + D_t with M_t = A_t ... A_1 and D_t the state reached from S_in = 0, so the
    outputs o_t = S_t^T q_t (q scaled) split into the slice's own part and a term linear in the incoming state:
        o_t = D_t^T q_t + S_in^T (M_t^T q_t).
    The recurrence treats every column of S (one value channel) on its own, so one run of the chunked kernel over the
    values [v | 0] ([K, V + K] state) from the initial state [0 | I] carries D_t in the first V columns and
    M_t = M_t I in the last K: its outputs are [D_t^T q_t | M_t^T q_t] (the output and the carried query) and its
    final state [D_T | M_T] (the transition). Given S_in, `continue_from` adds S_in^T (M_t^T q_t): the exact output,
    with no second pass, for K more value columns. The backward is autograd's through the kernel (either backend).
    The carried query leaves the kernel in v's dtype, so under bf16 the correction has the output's own precision.

    Packed rows: only a first document that continues the previous slice's starts with the identity columns; a
    document that starts inside the slice starts from [0 | 0], so its tokens get no correction, and when it is the
    slice's last one M_T = 0: the state passed on does not depend on the earlier slices.
    """
    batch_size, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    sequences = batch_size if cu_seqlens is None else len(cu_seqlens) - 1
    values = torch.cat([v, v.new_zeros(batch_size, seq_len, heads, key_dim)], dim=-1)  # [B, T, H, V + K]
    initial_state = q.new_zeros(sequences, heads, key_dim, value_dim + key_dim, dtype=torch.float32)
    if continues:
        continued = initial_state[:1] if cu_seqlens is not None else initial_state
        continued[..., value_dim:] = torch.eye(key_dim, dtype=torch.float32, device=q.device)
    output, final_state = kimi_delta_attention(
        q, k, values, g, beta, A_log, dt_bias, gate_lower_bound=gate_lower_bound, initial_state=initial_state,
        output_final_state=True, cu_seqlens=cu_seqlens, backend=backend,
    )  # fmt: skip
    output, carried_query = output.split([value_dim, key_dim], dim=-1)
    transition = final_state if cu_seqlens is None else final_state[-1:]
    return output, carried_query, transition


def incoming_states(transitions: torch.Tensor) -> torch.Tensor:
    """The state every slice starts from: transitions [slices, B, H, K, V + K] ([D | M] of each slice, in order) ->
    [slices, B, H, K, V], from S_in(0) = 0 through S_in(r + 1) = M_r S_in(r) + D_r."""
    key_dim = transitions.shape[-2]
    value_dim = transitions.shape[-1] - key_dim
    states = [transitions.new_zeros(transitions.shape[1:-1] + (value_dim,))]
    for contribution, carry in (t.split([value_dim, key_dim], dim=-1) for t in transitions[:-1].unbind(0)):
        states.append(carry @ states[-1] + contribution)
    return torch.stack(states)


def continue_from(output: torch.Tensor, carried_query: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
    """A slice's exact output given its incoming state [B, H, K, V]: output + S_in^T (M_t^T q_t), in output's dtype."""
    correction = torch.einsum("bthk,bhkv->bthv", carried_query.to(incoming.dtype), incoming)
    return (output + correction).to(output.dtype)


class ContextParallel:
    """The context-parallel process group of a text model and MLA's attention block size; `shard` describes each
    forward's slice."""

    def __init__(self, group, block_size: int = BLOCK_SIZE):
        self.group = group
        self.block_size = block_size

    def shard(
        self, config, inputs_embeds: torch.Tensor, position_ids: torch.Tensor | None, attention_mask, cache
    ) -> SequenceShard:
        """Check a forward's inputs and build its `SequenceShard` (two small all-gathers: the slice lengths and the
        position ids)."""
        if cache is not None:
            raise ValueError(
                "context parallelism splits one sequence across ranks for training or scoring and keeps no cache: "
                "pass use_cache=False (and no cache), or undo it with `context_parallel(model, None)` to generate."
            )
        if attention_mask is not None:
            raise ValueError(
                "context parallelism takes no attention_mask: give each rank its slice of unpadded or packed rows "
                "(position ids restarting at 0 per document) with `shard_batch`, which drops the mask."
            )
        group = self.group
        rank = dist.get_rank(group)
        batch_size, seq_len = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        shapes = gather_from_ranks(torch.tensor([batch_size, seq_len], device=device), group).tolist()
        if any(shape != [batch_size, seq_len] for shape in shapes):
            raise ValueError(
                f"context parallelism needs the same [batch, tokens] slice on every rank, got {shapes}: split each "
                "row into equal slices (`shard_batch` does; pad the row to a multiple of the group size)."
            )
        if seq_len < config.linear_conv_kernel_dim:
            raise ValueError(
                f"each rank's slice holds {seq_len} tokens, fewer than linear_conv_kernel_dim = "
                f"{config.linear_conv_kernel_dim} (the short conv reads its history from one previous rank): use "
                "fewer ranks or longer rows."
            )
        start = rank * seq_len
        if position_ids is None:
            position_ids = torch.arange(start, start + seq_len, device=device)[None]
        position_ids = position_ids.expand(batch_size, seq_len)
        global_positions = gather_from_ranks(position_ids, group).movedim(0, 1).flatten(1)  # [B, world * T]
        restarts = global_positions[:, 1:] == 0
        if batch_size > 1 and bool(restarts.any()):
            raise ValueError(
                "position ids restart at 0 inside a row of a batch of several rows; packed rows need batch size 1 "
                "(as on one process): flatten the batch into one row."
            )
        # the rule of one process: a row is packed when its position ids start at 0 and restart later
        packed = batch_size == 1 and bool(global_positions[0, 0] == 0) and bool(restarts.any())
        sequence_ids = (global_positions == 0).cumsum(-1) if packed else torch.zeros_like(global_positions)
        cu_seqlens = None
        if packed:
            local_starts = torch.nonzero(position_ids[0] == 0).flatten()
            cu_seqlens = torch.cat([
                torch.zeros(1, dtype=torch.int64, device=device), local_starts[local_starts > 0],
                torch.full((1,), seq_len, dtype=torch.int64, device=device),
            ])  # fmt: skip
        continues = rank > 0 and bool((sequence_ids[:, start] == sequence_ids[:, start - 1]).all())
        return SequenceShard(
            group, rank, start, position_ids, sequence_ids, cu_seqlens, continues, block_size=self.block_size
        )


def _context_parallel_group(mesh_or_group):
    """A DeviceMesh's "cp" dimension (or its only one), or a process group as is."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    if mesh_or_group.ndim == 1:
        return mesh_or_group.get_group()
    if "cp" not in (mesh_or_group.mesh_dim_names or ()):
        raise ValueError(
            f"a DeviceMesh of {mesh_or_group.ndim} dimensions needs one named 'cp' for context parallelism, got "
            f"{mesh_or_group.mesh_dim_names}; pass mesh['cp'] or the process group."
        )
    return mesh_or_group.get_group("cp")


def context_parallel(model: torch.nn.Module, mesh_or_group, *, block_size: int = BLOCK_SIZE) -> torch.nn.Module:
    """Split every forward's sequence across `mesh_or_group` (a process group, a 1-D DeviceMesh or a mesh with a
    "cp" dimension): each rank passes its slice (see `shard_batch`). `None` undoes it. Returns the model.
    `block_size`: MLA's query and key block (`blockwise_attention`), which bounds its scores to
    [B, heads, block_size, block_size] at a time.

    Applies to every kda-moe text model inside `model` (a causal LM, the multimodal model's language model, a
    wrapper around either)."""
    from ..modeling.modeling_kda_moe import KdaMoeTextModel

    text_models = [module for module in model.modules() if isinstance(module, KdaMoeTextModel)]
    if not text_models:
        raise ValueError(f"context_parallel found no KdaMoeTextModel inside {type(model).__name__}.")
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"block_size must be a positive int (tokens per MLA attention block), got {block_size!r}.")
    group = _context_parallel_group(mesh_or_group)
    for text_model in text_models:
        text_model.context_parallel = None if group is None else ContextParallel(group, block_size)
    return model


def shard_batch(batch: dict, group) -> dict:
    """This rank's slice of a batch of whole rows (input_ids [B, L], optional labels and position_ids, e.g. from
    `DataCollatorWithFlattening`) for a model under `context_parallel`.

    Returns input_ids, position_ids (global), labels, shift_labels (the labels shifted by one over the whole row,
    so a slice's last token is scored against the next slice's first) and num_items_in_batch (the scored tokens of
    the whole row). transformers' causal LM loss then gives each rank its share (sum / num_items_in_batch): the loss
    of the whole row is the sum over the ranks, and so are the gradients. L must be a multiple of the group size."""
    group = _context_parallel_group(group)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    input_ids = batch["input_ids"]
    length = input_ids.shape[-1]
    if length % world_size:
        raise ValueError(
            f"rows of {length} tokens do not split into {world_size} equal slices: pad them to a multiple of "
            f"{world_size} (e.g. pad_to_multiple_of, or one more packed document)."
        )
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "shard_batch takes unpadded rows (context parallelism runs without attention_mask): pack the documents "
            "into one row with position ids restarting at 0 (DataCollatorWithFlattening) instead of padding."
        )
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    own = slice(rank * (length // world_size), (rank + 1) * (length // world_size))
    shard = {"input_ids": input_ids[:, own], "position_ids": position_ids[:, own]}
    labels = batch.get("labels")
    if labels is not None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        shard.update(
            labels=labels[:, own],
            shift_labels=shift_labels[:, own].contiguous(),
            num_items_in_batch=(shift_labels != -100).sum(),
        )
    return shard


class ContextParallelCollator:
    """A data collator for context parallelism: `collator` (by default transformers' `DataCollatorWithFlattening`,
    which packs the examples into one row, position ids restarting at 0 at each document) builds the whole row(s),
    then `shard_batch` cuts out this rank's slice, with the shifted labels and the scored tokens of the whole row(s)
    (see `shard_batch`). Every rank of the group must collate the same examples.

    `mesh_or_group`: as `context_parallel` takes it. `pad_token_id`: when set, rows whose length does not split into
    equal slices get unscored pad tokens (labels -100) appended up to the next multiple of the group size, in packed
    rows as one more document; they change neither the loss nor the gradients (they do pass through the routers and
    count in Quantile Balancing's statistics). When None, such rows raise."""

    def __init__(self, mesh_or_group, collator=None, *, pad_token_id: int | None = None):
        if collator is None:
            from transformers import DataCollatorWithFlattening

            collator = DataCollatorWithFlattening(return_tensors="pt")
        self.group = _context_parallel_group(mesh_or_group)
        self.collator = collator
        self.pad_token_id = pad_token_id

    def __call__(self, features) -> dict:
        batch = dict(self.collator(features))
        padding = -batch["input_ids"].shape[-1] % dist.get_world_size(self.group)
        if padding and self.pad_token_id is not None:
            batch = _pad_row(batch, padding, self.pad_token_id)
        return shard_batch(batch, self.group)


def _pad_row(batch: dict, padding: int, pad_token_id: int) -> dict:
    """`padding` unscored tokens appended to every row: a document of their own in packed rows (position ids from 0);
    after the last token of plain rows (no position_ids), which causal attention keeps from every earlier token."""
    input_ids = batch["input_ids"]
    if batch.get("position_ids") is not None:
        positions = torch.arange(padding, device=input_ids.device).expand(input_ids.shape[0], -1)
        batch["position_ids"] = torch.cat([batch["position_ids"], positions.to(batch["position_ids"].dtype)], dim=-1)
    batch["input_ids"] = F.pad(input_ids, (0, padding), value=pad_token_id)
    if batch.get("labels") is not None:
        batch["labels"] = F.pad(batch["labels"], (0, padding), value=-100)
    if batch.get("attention_mask") is not None:
        batch["attention_mask"] = F.pad(batch["attention_mask"], (0, padding), value=1)
    return batch


__all__ = [
    "ContextParallel",
    "ContextParallelCollator",
    "SequenceShard",
    "blockwise_attention",
    "context_parallel",
    "continue_from",
    "gather_from_ranks",
    "incoming_states",
    "shard_batch",
    "slice_transition",
]
