"""Greedy decoding on a static cache in blocks of steps, each block one CUDA-graph replay.

transformers' decoding loop (`GenerationMixin._sample`) runs the compiled decode step once per token and spends about
a millisecond of host time around it (the step's inputs and masks, the compiled call's guards and input checks, logits
processing, stopping criteria): at small batch more than the step's GPU time. Here everything a step reads lives in
fixed tensors (`DecodeState`: the last token, its position id and cache position, the padding of the prompt, the
unfinished rows), and the step advances them itself, so `steps_per_graph` consecutive steps are captured as one CUDA
graph and replayed until every row has finished or the length limit is reached. The host looks at the tokens once a
block; steps run after the last row finished, or past the last token (the cache is a block longer), are dropped, as
transformers' deferred stopping check drops its extra steps. The tokens are those of transformers' greedy loop: the
same compiled forward, the same masks and position ids. The model keeps the decoder (graph, state and cache) for the
next generate() call of the same batch size.

On a GPU greedy decoding on a compiled static cache takes blocks of `DECODE_STEPS_PER_GRAPH` steps unless
`generation_config.decode_steps_per_graph` says otherwise (`decode_steps_per_graph`). Without a GPU the blocks run
step by step (no graph) when asked for, which checks the loop's logic anywhere. On Hopper GPUs the step's kernels,
ours and inductor's, launch as programmatically dependent (`uncaptured_compile_call`).
"""

import functools

import torch
from transformers.generation import CompileConfig

from ..compat import CACHE_NAME
from ..kernels.dependent_launch import dependent_launch_supported, dependent_launches

# steps run before the capture: the first compiles the step, the second shows that it needs no recompilation (a
# compilation inside the capture would fail)
WARM_UP_STEPS = 2
# steps per block on a GPU where `generation_config.decode_steps_per_graph` is unset (on an H100, anchor config, 2K
# prompts: 0.70 ms a step at batch 1 and 1.67 ms at batch 32, against 1.81 and 2.66 ms step by step)
DECODE_STEPS_PER_GRAPH = 16


def decode_steps_per_graph(generation_config, device: torch.device) -> int | None:
    """How many greedy steps one block takes: `generation_config.decode_steps_per_graph` where set (None: transformers'
    step-by-step loop); unset, `DECODE_STEPS_PER_GRAPH` on a GPU, where a block is one CUDA-graph replay, and None
    elsewhere. Anything but a positive int or None raises."""
    if not hasattr(generation_config, "decode_steps_per_graph"):
        return DECODE_STEPS_PER_GRAPH if device.type == "cuda" else None
    steps = generation_config.decode_steps_per_graph
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(
            f"generation_config.decode_steps_per_graph must be a positive number of decode steps (or None for "
            f"transformers' step-by-step loop), got {steps!r}."
        )
    return steps


class DecodeState:
    """The inputs of the next decode step in tensors allocated once and updated in place, by the step itself and by
    `start` at each generate() call (fixed addresses: a CUDA graph reads them)."""

    def __init__(self, batch_size: int, cache_length: int | None, device):
        self.token = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] the last token, fed to the step
        self.position_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1] its position id
        self.cache_position = torch.zeros((), dtype=torch.long, device=device)  # [] its index in the static cache
        self.unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)  # [B] rows without an end token
        # MLA layers only: [B, S] the cache positions the padding mask keeps (every generated one), [S] 0 .. S - 1
        self.kept = None if cache_length is None else torch.ones(batch_size, cache_length, dtype=torch.bool, device=device)
        self.columns = None if cache_length is None else torch.arange(cache_length, device=device)

    def start(self, first_token, unfinished, attention_mask, prompt_length: int) -> None:
        """Before the first decode step: `first_token` [B] (chosen from the prefill's logits) goes at cache position
        `prompt_length`; `attention_mask` [B, prompt_length] is the prompt's padding mask (None: no padding)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(self.token, dtype=torch.bool)[:, None].expand(-1, prompt_length)
        attention_mask = attention_mask.bool()
        self.token.copy_(first_token)
        self.position_ids.copy_(attention_mask.sum(-1, keepdim=True))  # transformers: cumsum(mask) - 1 at the token
        self.cache_position.fill_(prompt_length)
        self.unfinished.copy_(unfinished)
        if self.kept is not None:
            self.kept.fill_(True)
            self.kept[:, :prompt_length] = attention_mask


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
    captures them), built once per config. Where our decoding kernels can launch as dependent
    (`dependent_launch_supported`) and the config leaves inductor's mode at its default, inductor's kernels launch so
    too (`triton.enable_pdl`) and the call runs inside `dependent_launches()`: the captured step is one chain of
    dependent launches."""
    options = compile_config.to_dict()
    if options.get("mode") == "reduce-overhead":
        options["mode"] = "default"
    dependent = (
        options.get("backend") == "inductor"
        and options.get("mode") in (None, "default")
        and hasattr(torch._inductor.config.triton, "enable_pdl")
        and dependent_launch_supported(model.device)
    )
    if dependent:  # torch.compile takes a mode or options, not both
        options["mode"], options["options"] = None, {**(options.get("options") or {}), "triton.enable_pdl": True}
    if options.get("options"):
        options["options"] = {**options["options"], "triton.cudagraphs": False}
    key = repr(sorted(options.items()))
    if getattr(model, "_uncaptured_compile", (None,))[0] != key:
        compiled = torch.compile(model.__call__, **options)
        model._uncaptured_compile = (key, functools.partial(call_dependent, compiled) if dependent else compiled)
    return model._uncaptured_compile[1]


def call_dependent(forward, *args, **kwargs):
    """`forward(*args, **kwargs)` with the decoding kernels launched as dependent (`dependent_launches`)."""
    with dependent_launches():
        return forward(*args, **kwargs)


class GraphedDecoder:
    """Greedy decode steps on one static cache for one batch shape, in blocks of `steps_per_graph`: on CUDA the first
    call warms the compiled step up (`WARM_UP_STEPS` steps) and captures a block as one CUDA graph, and every block of
    this and later generate() calls is a replay of it. The model keeps its last decoder (`greedy_decoding`), with the
    cache the graph reads (`KdaMoeForCausalLM._prepare_cache_for_generation` hands that cache out again), so a
    generate() call with the same settings pays no capture."""

    def __init__(self, forward, cache, batch_size: int, steps_per_graph: int, mla_mask, end_ids, pad_id, dtype, device):
        self.key = (forward, cache, batch_size, steps_per_graph, mla_mask, None if end_ids is None else end_ids.shape)
        self.batch_size, self.device = batch_size, torch.device(device)
        self.forward, self.cache, self.steps_per_graph, self.mla_mask, self.dtype = (
            forward, cache, steps_per_graph, mla_mask, dtype
        )  # fmt: skip
        self.state = DecodeState(batch_size, None if mla_mask is None else cache.get_max_length(), device)
        self.end_ids = None if end_ids is None else end_ids.clone()  # the graph reads these tensors: kept, refilled
        self.pad_id = None if pad_id is None else pad_id.clone()
        self.graph, self.block = None, None

    def serves(self, forward, cache, batch_size, steps_per_graph, mla_mask, end_ids) -> bool:
        key = (forward, cache, batch_size, steps_per_graph, mla_mask, None if end_ids is None else end_ids.shape)
        return all(a is b or a == b for a, b in zip(key, self.key))

    def fits(self, batch_size: int, length: int, dtype, device) -> bool:
        """Whether this decoder's cache holds `batch_size` sequences of `length` tokens in `dtype` on `device`."""
        cache_length = self.cache.get_max_length()  # -1 without MLA layers: any length
        return (
            (batch_size, dtype, torch.device(device)) == (self.batch_size, self.dtype, self.device)
            and (cache_length < 0 or cache_length >= length)
        )

    def start(self, first_token, unfinished, attention_mask, prompt_length: int, end_ids, pad_id) -> None:
        self.state.start(first_token, unfinished, attention_mask, prompt_length)
        if end_ids is not None:
            self.end_ids.copy_(end_ids)
            self.pad_id.copy_(pad_id)

    def step(self) -> torch.Tensor:
        return decode_step(self.forward, self.cache, self.state, self.end_ids, self.pad_id, self.mla_mask, self.dtype)

    def steps(self, count: int) -> torch.Tensor:
        return torch.stack([self.step() for _ in range(count)], dim=1)  # [B, count]

    def warm_up_and_capture(self) -> torch.Tensor:
        """Run `WARM_UP_STEPS` real steps on a side stream (compilation and autotuning, as torch's CUDA graphs ask),
        then capture one block (recorded, not run); returns the warm-up steps' tokens [B, WARM_UP_STEPS]."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tokens = self.steps(WARM_UP_STEPS)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.block = self.steps(self.steps_per_graph)
        return tokens

    def run(self, max_new_tokens: int, room: float, capture: bool) -> torch.Tensor:
        """Steps until every row has finished or `max_new_tokens` tokens were made; a block may run past the end
        while the cache has `room` for that many steps (its extra tokens are cut later). Returns the tokens [B, run].

        The host reads whether any row is unfinished one block late: it launches a block, then waits for the flag
        of the block before it, so the GPU never idles while the host checks and launches. Up to one block runs
        after the one in which every row finished; its tokens are cut with the others past the end."""
        k = self.steps_per_graph
        blocks, made = [], 0
        if capture and self.graph is None and max_new_tokens > WARM_UP_STEPS and WARM_UP_STEPS + k <= room:
            blocks.append(self.warm_up_and_capture())
            made = WARM_UP_STEPS
        flags = [UnfinishedFlag(self.device) for _ in range(2)]  # the last two blocks' "a row is unfinished"
        flags[0].record(self.state.unfinished)
        while made < max_new_tokens:
            if made + k <= room and (self.graph is not None or not capture):
                if self.graph is not None:
                    self.graph.replay()
                    blocks.append(self.block.clone())
                else:
                    blocks.append(self.steps(k))
                made += k
            else:  # no graph, or a block would not fit the cache: the rest step by step
                blocks.append(self.steps(1))
                made += 1
            flags.reverse()
            flags[0].record(self.state.unfinished)
            if not flags[1].read():  # every row had finished before this block
                break
        return torch.cat(blocks, dim=1)[:, :max_new_tokens]


class UnfinishedFlag:
    """Whether any row is unfinished, copied to the host behind the work queued so far, read when that work is done
    (on a CPU: at once)."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.host = torch.ones((), dtype=torch.bool, pin_memory=self.on_gpu)
        self.copied = torch.cuda.Event() if self.on_gpu else None

    def record(self, unfinished: torch.Tensor) -> None:
        self.host.copy_(unfinished.any(), non_blocking=self.on_gpu)
        if self.on_gpu:
            self.copied.record()

    def read(self) -> bool:
        if self.on_gpu:
            self.copied.synchronize()
        return bool(self.host)


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
    graphs, through the model's `GraphedDecoder` for this cache and batch (built here when it has none)."""
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
        decoder = model.__dict__.get("_graphed_decoder")
        if decoder is None or not decoder.serves(forward, cache, batch_size, steps_per_graph, mla_mask, end_ids):
            decoder = model._graphed_decoder = None  # a new one: drop the old graph's memory first
            decoder = GraphedDecoder(
                forward, cache, batch_size, steps_per_graph, mla_mask, end_ids, pad_id, model.dtype, input_ids.device
            )
            model._graphed_decoder = decoder
        decoder.start(first, unfinished, model_kwargs.get("attention_mask"), prompt_length, end_ids, pad_id)
        length = cache.get_max_length()  # -1 without MLA layers: no limit
        room = float("inf") if length < 0 else length - prompt_length  # decode steps the cache has positions for
        with model._optimize_model_for_decode():
            later = decoder.run(max_new_tokens - 1, room, capture)
        tokens = torch.cat([tokens, later], dim=1)
    tokens = tokens[:, : steps_until_finished(tokens, end_ids)]
    return torch.cat([input_ids, tokens], dim=1)
