"""Long prompts through a causal LM a chunk of tokens at a time, without generate().

Each chunk continues the cache the previous chunks filled (KDA conv and recurrent states carried over, MLA latents
appended), so the result is the cache and the logits of one forward over the whole prompt, while the activations of
a forward never span more than `chunk_size` tokens: KDA layers need the same memory whatever the prompt length, MLA
layers memory linear in it (their latent cache, and the chunk's attention over it). Under SDPA, MLA layers attend an
unpadded chunk over the cache through a lower-right causal bias, which SDPA's fused CUDA kernels apply without a mask
tensor; a batch with padding builds the boolean mask [batch, 1, chunk, cache] instead.

`generate()` does the same through transformers' own option, `model.generate(..., prefill_chunk_size=N)` (or
`generation_config.prefill_chunk_size`): its chunks keep the logits of their last position only.
"""

from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from ..compat import CACHE_NAME, cached_token_count, output_cache


def forward_chunks(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    chunk_size: int,
    logits_to_keep: int,
) -> Iterator[tuple[int, ModelOutput]]:
    """Yield (start, output) for `input_ids[:, start : start + chunk_size]`, run on the cache of the chunks before.

    `attention_mask` [batch, cached + new tokens] covers the tokens `cache` already holds and the new ones, as in a
    plain forward; each chunk gets its columns up to the chunk's end.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive number of tokens, got {chunk_size!r}.")
    if input_ids.ndim != 2:
        raise ValueError(f"`input_ids` must be [batch, seq_len], got shape {tuple(input_ids.shape)}.")
    batch_size, new_tokens = input_ids.shape
    cached = 0 if cache is None else cached_token_count(cache)
    if attention_mask is not None:
        if cached is None:  # a cache that cannot count its tokens: the mask says how many it holds
            cached = attention_mask.shape[-1] - new_tokens
        if tuple(attention_mask.shape) != (batch_size, cached + new_tokens):
            raise ValueError(
                f"`attention_mask` must be [batch, cached + new tokens] = [{batch_size}, {cached} + {new_tokens}], "
                f"got shape {tuple(attention_mask.shape)}: one row per sequence, with an entry for every token the "
                "cache holds and every token of `input_ids`."
            )
    for start in range(0, new_tokens, chunk_size):
        end = min(start + chunk_size, new_tokens)
        output = model(
            input_ids=input_ids[:, start:end],
            attention_mask=None if attention_mask is None else attention_mask[:, : cached + end],
            **{CACHE_NAME: cache},
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        cache = output_cache(output)
        yield start, output


@torch.no_grad()
def prefill_in_chunks(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | None = None,
    chunk_size: int = 4096,
) -> ModelOutput:
    """Fill `cache` with a long prompt, `chunk_size` tokens per forward, and return the last forward's output: the
    logits of the prompt's last position ([batch, 1, vocab]) and the cache (a new one when `cache` is None), the same
    as one forward over the prompt with `logits_to_keep=1` would give.

    `attention_mask`: [batch, cached + new tokens] (left padding as usual). To generate from the filled cache, leave
    the last prompt token out of the prefill: `generate()` must see at least one token the cache does not hold.

        cache = prefill_in_chunks(model, input_ids[:, :-1], chunk_size=8192).cache
        out = model.generate(input_ids, cache=cache, max_new_tokens=64)   # `past_key_values=` on transformers 5.17
    """
    output = None
    for _, output in forward_chunks(model, input_ids, attention_mask, cache, chunk_size, logits_to_keep=1):
        pass
    return output


@torch.no_grad()
def score_in_chunks(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """Log-probabilities of a long sequence's tokens, `chunk_size` tokens per forward: [batch, seq_len - 1] fp32,
    entry t = log p(input_ids[:, t + 1] | input_ids[:, : t + 1]). No forward builds logits for more than `chunk_size`
    positions. Entries whose target token is padding (`attention_mask` 0) are 0."""
    log_probs, carried = [], None  # carried [B, V]: the previous chunk's prediction for this chunk's first token
    for start, output in forward_chunks(model, input_ids, attention_mask, None, chunk_size, logits_to_keep=0):
        predictions = output.logits.float().log_softmax(-1)  # [B, C, V]
        targets = input_ids[:, start : start + predictions.shape[1]]
        if carried is not None:
            log_probs.append(carried.gather(-1, targets[:, :1]))
        log_probs.append(predictions[:, :-1].gather(-1, targets[:, 1:, None]).squeeze(-1))
        carried = predictions[:, -1]
    log_probs = torch.cat(log_probs, dim=1)
    if attention_mask is not None:
        log_probs = log_probs.masked_fill(attention_mask[:, 1:] == 0, 0.0)
    return log_probs


__all__ = ["prefill_in_chunks", "score_in_chunks"]
