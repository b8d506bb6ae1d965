"""Greedy decoding on a static cache in blocks of steps, each block one CUDA-graph replay.

transformers' decoding loop (`GenerationMixin._sample`) runs the compiled decode step once per token and spends about
a millisecond of host time around it (the step's inputs and masks, the compiled call's guards and input checks, logits
processing, stopping criteria): at small batch more than the step's GPU time. Here everything a step reads lives in
fixed tensors (`DecodeState`: the last token, its position id and cache position, the padding of the prompt, the
unfinished rows), and the step advances them itself, so `steps_per_graph` consecutive steps are captured as one CUDA
graph and replayed until every row has finished or the length limit is reached. The host looks at the tokens once a
block; steps run after the last row finished are dropped, as transformers' deferred stopping check drops its extra
steps. The tokens are those of transformers' greedy loop: the same compiled forward, the same masks and position ids.

Without a GPU the blocks run step by step (no graph), which checks the loop's logic anywhere.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.generation import CompileConfig

from ..compat import CACHE_NAME

# steps run before the capture: the first compiles the step, the second shows that it needs no recompilation (a
# compilation inside the capture would fail)
WARM_UP_STEPS = 2


@dataclass
class DecodeState:
    """The inputs of the next decode step, updated in place by the step (fixed addresses: a CUDA graph reads them)."""

    token: torch.Tensor  # [B] the last token, fed to the next step
    position_ids: torch.Tensor  # [B, 1] its position id (the count of unpadded tokens before it)
    cache_position: torch.Tensor  # [] its index in the static cache
    unfinished: torch.Tensor  # [B] bool: rows that have not produced an end-of-sequence token
    kept: torch.Tensor | None  # [B, S] bool: the cache positions the padding mask keeps (every generated one)
    columns: torch.Tensor | None  # [S] 0 .. S - 1 (both None without MLA layers)


def start_state(first_token, attention_mask, prompt_length: int, cache_length: int | None) -> DecodeState:
    """The state before the first decode step: `first_token` [B] (chosen from the prefill's logits) goes at cache
    position `prompt_length`; `attention_mask` [B, prompt_length] is the prompt's padding mask (None: no padding);
    `cache_length`: the MLA layers' cache length S (None without MLA layers)."""
    batch_size, device = first_token.shape[0], first_token.device
    if attention_mask is None:
        attention_mask = torch.ones(batch_size, prompt_length, dtype=torch.bool, device=device)
    attention_mask = attention_mask.bool()
    return DecodeState(
        token=first_token.clone(),
        position_ids=attention_mask.sum(-1, keepdim=True),  # transformers: cumsum(mask) - 1 at the new token
        cache_position=torch.tensor(prompt_length, device=device),
        unfinished=torch.ones(batch_size, dtype=torch.bool, device=device),
        kept=None if cache_length is None else F.pad(attention_mask, (0, cache_length - prompt_length), value=True),
        columns=None if cache_length is None else torch.arange(cache_length, device=device),
    )


def choose_tokens(logits: torch.Tensor, unfinished: torch.Tensor, end_ids, pad_id) -> torch.Tensor:
    """Greedy choice from the last position's logits [B, T, V], as transformers makes it: argmax over the fp32
    logits, the pad token for rows that have finished; rows that produce an end id finish (`unfinished` in place)."""
    tokens = logits[:, -1].float().argmax(-1)
    if end_ids is None:
        return tokens
    tokens = torch.where(unfinished, tokens, pad_id)
    unfinished &= ~torch.isin(tokens, end_ids)
    return tokens


def decode_step(forward, cache, state: DecodeState, end_ids, pad_id, mla_mask: str | None, dtype) -> torch.Tensor:
    """One greedy step on the static cache: feeds `state.token`, returns the next token [B] and advances `state`.

    `mla_mask`: None (no MLA layers), "bool" (SDPA) or "additive" (eager attention): the MLA layers' mask over the
    cache [B, 1, 1, S], what `static_cache_causal_mask` builds from the 2-D padding mask."""
    masks = {"linear_attention": None}  # a one-token step has no padding
    if mla_mask is not None:
        visible = (state.kept & (state.columns <= state.cache_position))[:, None, None, :]
        if mla_mask == "additive":
            visible = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
                ~visible, torch.finfo(dtype).min
            )
        masks["full_attention"] = visible
    logits = forward(
        input_ids=state.token[:, None],
        position_ids=state.position_ids,
        attention_mask=masks,
        use_cache=True,
        logits_to_keep=1,
        return_dict=True,
        **{CACHE_NAME: cache},
    ).logits
    tokens = choose_tokens(logits, state.unfinished, end_ids, pad_id)
    state.token.copy_(tokens)
    state.position_ids.add_(1)
    state.cache_position.add_(1)
    return tokens


def uncaptured_compile_call(model, compile_config: CompileConfig):
    """`torch.compile(model.__call__)` with `compile_config`'s settings but no CUDA graphs of its own (this module
    captures them), built once per config."""
    options = compile_config.to_dict()
    if options.get("mode") == "reduce-overhead":
        options["mode"] = "default"
    if options.get("options"):
        options["options"] = {**options["options"], "triton.cudagraphs": False}
    key = repr(sorted(options.items()))
    if getattr(model, "_uncaptured_compile", (None,))[0] != key:
        model._uncaptured_compile = (key, torch.compile(model.__call__, **options))
    return model._uncaptured_compile[1]


def run_blocks(step, state: DecodeState, max_new_tokens: int, steps_per_graph: int, capture: bool) -> torch.Tensor:
    """Run `step()` (one decode step, returns the tokens [B]) until every row has finished or `max_new_tokens`
    tokens were made; on CUDA (`capture`) the first `WARM_UP_STEPS` steps run plain (compilation, autotuning),
    then `steps_per_graph` steps are captured as one CUDA graph and replayed. Returns the tokens [B, steps run]."""
    blocks, made = [], 0

    def finished() -> bool:
        return made >= max_new_tokens or not bool(state.unfinished.any())

    if capture and max_new_tokens > WARM_UP_STEPS + steps_per_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, on a side stream as torch's CUDA graphs ask
            blocks += [step()[:, None] for _ in range(WARM_UP_STEPS)]
        torch.cuda.current_stream().wait_stream(side)
        made = WARM_UP_STEPS
        if not finished():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                block = torch.stack([step() for _ in range(steps_per_graph)], dim=1)  # [B, steps_per_graph]
            while made + steps_per_graph <= max_new_tokens and not finished():
                graph.replay()
                blocks.append(block.clone())
                made += steps_per_graph
            del graph
    while not finished():  # the steps left over (all of them without a graph), checked one by one
        chunk = min(steps_per_graph, max_new_tokens - made)
        blocks.append(torch.stack([step() for _ in range(chunk)], dim=1))
        made += chunk
    return torch.cat(blocks, dim=1)


def steps_until_finished(tokens: torch.Tensor, end_ids) -> int:
    """How many of the steps in `tokens` [B, N] transformers' loop runs: up to the step where the last row produced
    an end id (all N when a row never does)."""
    if end_ids is None:
        return tokens.shape[1]
    ended = torch.isin(tokens, end_ids)
    if not bool(ended.any(-1).all()):
        return tokens.shape[1]
    return int(ended.int().argmax(-1).max()) + 1  # each row's first end id


def greedy_decoding(
    model, input_ids, stopping_criteria, generation_config, model_kwargs, mla_mask, forward, steps_per_graph, capture
):
    """Greedy decoding after the prefill: `input_ids` [B, L] with the generated tokens appended, as `_sample`
    returns them. `forward` is the compiled model call; `capture` replays blocks of `steps_per_graph` steps as CUDA
    graphs."""
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    cache = model_kwargs[CACHE_NAME]
    end_ids = generation_config._eos_token_tensor
    if not any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria):
        end_ids = None
    pad_id = generation_config._pad_token_tensor
    batch_size, prompt_length = input_ids.shape
    max_new_tokens = stopping_criteria.max_length - prompt_length
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=input_ids.device)
    first = choose_tokens(outputs.logits, unfinished, end_ids, pad_id)
    del outputs
    tokens = first[:, None]
    if max_new_tokens > 1 and bool(unfinished.any()):
        cache_length = None if mla_mask is None else cache.get_max_length()
        state = start_state(first, model_kwargs.get("attention_mask"), prompt_length, cache_length)
        state.unfinished.copy_(unfinished)

        def step():
            return decode_step(forward, cache, state, end_ids, pad_id, mla_mask, model.dtype)

        with model._optimize_model_for_decode():
            later = run_blocks(step, state, max_new_tokens - 1, steps_per_graph, capture)
        tokens = torch.cat([tokens, later], dim=1)
    tokens = tokens[:, : steps_until_finished(tokens, end_ids)]
    return torch.cat([input_ids, tokens], dim=1)
