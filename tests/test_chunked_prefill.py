"""Chunked prefill (CPU, fp32): generate()'s `prefill_chunk_size` and `prefill_in_chunks` / `score_in_chunks` give
what one forward over the whole prompt gives, fill the same cache, and need activation memory that does not grow with
the prompt in KDA layers; MLA layers attend an unpadded chunk over the cache through PyTorch's lower-right causal bias,
never a [chunk, cache] mask tensor. A hybrid model (KDA and MLA layers) and a pure-KDA one."""

import weakref
from contextlib import contextmanager

import pytest
import torch
from conftest import tiny_model
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.masking_utils import create_causal_mask

from kda_moe import KdaMoeCache, KdaMoeStaticCache, prefill_in_chunks, score_in_chunks
from kda_moe.compat import CACHE_NAME, output_cache
from kda_moe.modeling.modeling_kda_moe import KdaMoeAttention, layer_type_masks

LAYOUTS = {
    "hybrid": {},  # KDA, KDA, KDA, MLA, MLA
    "pure_kda": dict(
        num_hidden_layers=3, layer_types=["linear_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"]
    ),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    model = tiny_model(seed=0, **LAYOUTS[request.param])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero AttnRes pseudo-queries: the depth mixing is not a plain average
        for name, param in model.named_parameters():
            if name.endswith("res.proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def prompts(batch_size=2, length=23, padding=5, seed=0):
    """Random ids and a mask whose first row has `padding` left pad tokens (they span a first chunk of 4)."""
    input_ids = torch.randint(1, 97, (batch_size, length), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :padding] = 0
    input_ids[0, :padding] = 0
    return input_ids, attention_mask


GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
PADDINGS = pytest.mark.parametrize("padding", [0, 5], ids=["unpadded", "left_padded"])


@PADDINGS
@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("chunk_size", [4, 7])
def test_generate_with_prefill_chunks_gives_the_unchunked_greedy_tokens(
    model, chunk_size, cache_implementation, padding
):
    """An unpadded batch, and left padding that spans the first chunk of 4 and part of the next; the default cache
    and the static one."""
    input_ids, attention_mask = prompts(padding=padding)
    with torch.no_grad():
        unchunked = model.generate(input_ids, attention_mask=attention_mask, **GREEDY)
        chunked = model.generate(
            input_ids,
            attention_mask=attention_mask,
            prefill_chunk_size=chunk_size,
            cache_implementation=cache_implementation,
            **GREEDY,
        )
    assert torch.equal(chunked, unchunked)


def test_each_prefill_chunk_computes_the_logits_of_its_last_position_only(model):
    """generate() passes `logits_to_keep=1` to every chunk: `lm_head` never sees more than one position per row, so
    no chunk builds [tokens, vocab] logits."""
    input_ids, attention_mask = prompts()
    lm_head_inputs = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: lm_head_inputs.append(tuple(args[0].shape)))
    try:
        with torch.no_grad():
            model.generate(input_ids, attention_mask=attention_mask, prefill_chunk_size=4, **GREEDY)
    finally:
        hook.remove()
    assert lm_head_inputs == [(2, 1, model.config.hidden_size)] * (6 + GREEDY["max_new_tokens"] - 1)


def cache_tensors(cache):
    """Per layer: (conv state, recurrent state) of a KDA layer, (latents, rope keys) of an MLA layer."""
    return [
        (layer.conv_states[0], layer.recurrent_states[0])
        if hasattr(layer, "recurrent_states")
        else (layer.keys, layer.values)
        for layer in cache.layers
    ]


@PADDINGS
@pytest.mark.parametrize("chunk_size", [4, 8, 23])
def test_cache_after_chunked_prefill_matches_one_forward(model, chunk_size, padding):
    """KDA conv and recurrent states and MLA latents after `prefill_in_chunks` are those of one forward over the
    prompt, within fp32 rounding (the KDA recurrence adds in another order when its state crosses a chunk boundary,
    and MLA attends over cached latents in the absorbed form: the layers after them see inputs that differ in the
    last bits), and the last position's logits agree."""
    input_ids, attention_mask = prompts(padding=padding)
    with torch.no_grad():
        whole = model(input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
    chunked = prefill_in_chunks(model, input_ids, attention_mask, chunk_size=chunk_size)
    whole_cache, chunked_cache = output_cache(whole), output_cache(chunked)
    assert isinstance(chunked_cache, KdaMoeCache) and chunked_cache.get_seq_length() == input_ids.shape[1]
    for (a, b), (c, d) in zip(cache_tensors(chunked_cache), cache_tensors(whole_cache), strict=True):
        assert a.shape == c.shape and b.shape == d.shape
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, d, rtol=1e-5, atol=1e-5)
    assert chunked.logits.shape == (2, 1, model.config.vocab_size)
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [20, 30])
def test_a_chunk_over_a_cache_takes_the_cheaper_mla_form_and_the_same_logits(model, chunk_size):
    """`absorbed_attention_max_tokens` is 24 at the tiny widths (kv_lora 12, nope 8, v 8): a second chunk of 20
    attends in the absorbed form (kv_b_proj never called on it), one of 30 expands the whole cache (kv_b_proj over
    every cached and new token); both give one forward's logits, and padding is handled by the expanded form too."""
    if "full_attention" not in model.config.layer_types:
        pytest.skip("no MLA layer")
    attention = next(module for module in model.modules() if isinstance(module, KdaMoeAttention))
    assert attention.absorbed_max_tokens == 24
    input_ids, attention_mask = prompts(length=2 * chunk_size, padding=5)
    expanded_lengths = []
    hook = attention.kv_b_proj.register_forward_hook(lambda module, args, out: expanded_lengths.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            whole = model(input_ids, attention_mask=attention_mask, logits_to_keep=1)
        chunked = prefill_in_chunks(model, input_ids, attention_mask, chunk_size=chunk_size)
    finally:
        hook.remove()
    second_chunk = [2 * chunk_size] if chunk_size > 24 else []
    assert expanded_lengths == [2 * chunk_size, chunk_size, *second_chunk]
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=1e-5, atol=1e-5)


def mask_kind(mask):
    """("lower_right", T, S) for PyTorch's lower-right causal bias, ("dense", shape) for a mask tensor, or None."""
    if isinstance(mask, CausalBias):
        assert mask.variant == CausalVariant.LOWER_RIGHT and mask.untyped_storage().nbytes() == 0
        return ("lower_right", mask.seq_len_q, mask.seq_len_kv)
    return None if mask is None else ("dense", tuple(mask.shape))


@contextmanager
def mla_masks(model):
    """The `mask_kind` of every mask the model's MLA layers are called with, in call order."""
    seen = []

    def record(module, args, kwargs):
        seen.append(mask_kind(kwargs["attention_mask"]))

    attention = [module for module in model.modules() if isinstance(module, KdaMoeAttention)]
    hooks = [module.register_forward_pre_hook(record, with_kwargs=True) for module in attention]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


@PADDINGS
def test_mla_layers_attend_prefill_chunks_over_the_cache_through_a_lower_right_causal_bias_unless_padded(padding):
    """A 23-token prompt in chunks of 7 (7, 7, 7, 2), through `prefill_in_chunks` and generate() with 2 tokens decoded
    after the prefill: both MLA layers attend the first chunk without a mask (SDPA's `is_causal`), and every later
    chunk, when no token is padded, through PyTorch's lower-right causal bias over the cache, which holds no
    [chunk, cache] tensor; a left-padded batch keeps transformers' dense masks [B, 1, chunk, cache], and decoding
    steps keep theirs (none without padding)."""
    model = tiny_model(seed=0)
    input_ids, attention_mask = prompts(padding=padding)
    with mla_masks(model) as prefilled:
        prefill_in_chunks(model, input_ids, attention_mask, chunk_size=7)
    with mla_masks(model) as generated, torch.no_grad():
        model.generate(input_ids, attention_mask=attention_mask, prefill_chunk_size=7, max_new_tokens=3,
                       do_sample=False, pad_token_id=0)
    if padding:
        chunks = [("dense", (2, 1, tokens, cached + tokens)) for cached, tokens in [(0, 7), (7, 7), (14, 7), (21, 2)]]
        steps = [("dense", (2, 1, 1, 24)), ("dense", (2, 1, 1, 25))]
    else:
        chunks = [None, ("lower_right", 7, 14), ("lower_right", 7, 21), ("lower_right", 2, 23)]
        steps = [None, None]
    assert prefilled == [kind for kind in chunks for _mla_layer in range(2)]
    assert generated == [kind for kind in chunks + steps for _mla_layer in range(2)]


def cache_holding(model, input_ids, static):
    """A cache after a forward over `input_ids`: the dynamic one, or a static one with room for 20 tokens."""
    cache = KdaMoeStaticCache(model.config, max_cache_len=20) if static else KdaMoeCache(model.config)
    with torch.no_grad():
        return output_cache(model(input_ids, **{CACHE_NAME: cache}, use_cache=True))


MASK_CASES = {  # name: (attention implementation, cached tokens, new tokens, left padding, static cache)
    "no_mask": ("sdpa", 9, 5, None, False),
    "all_ones": ("sdpa", 9, 5, 0, False),
    "left_padded": ("sdpa", 9, 5, 3, False),
    "eager": ("eager", 9, 5, 0, False),
    "first_forward": ("sdpa", 0, 5, 0, False),
    "decoding_step": ("sdpa", 9, 1, 0, False),
    "static_cache": ("sdpa", 9, 5, 0, True),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_mla_layers_get_a_lower_right_causal_bias_exactly_for_unpadded_chunks_over_a_dynamic_cache(case):
    """`layer_type_masks` gives MLA layers a lower-right causal bias (no tensor of the mask's size) where several new
    tokens continue a dynamic cache that holds tokens, under SDPA, with no padding: the causal mask transformers would
    build there, row by row. Padding, eager attention, a first forward, a decoding step and a static cache keep the
    mask transformers' `create_causal_mask` gives."""
    implementation, cached, new, padding, static = MASK_CASES[case]
    model = tiny_model(seed=0)
    model.set_attn_implementation(implementation)
    input_ids = prompts(padding=0)[0][:, : cached + new]
    attention_mask = None if padding is None else torch.ones_like(input_ids)
    if padding:
        attention_mask[0, :padding] = 0
    cache = cache_holding(model, input_ids[:, :cached], static) if cached else None
    embeds = model.get_input_embeddings()(input_ids[:, cached:])
    position_ids = torch.arange(cached, cached + new)[None]
    mask = layer_type_masks(model.config, embeds, attention_mask, cache, position_ids)["full_attention"]
    expected = create_causal_mask(model.config, embeds, attention_mask, cache, position_ids=position_ids)
    if case in ("no_mask", "all_ones"):
        assert mask_kind(mask) == ("lower_right", new, cached + new)
        dense = create_causal_mask(model.config, embeds, attention_mask, cache, position_ids=position_ids,
                                   allow_is_causal_skip=False)  # [B, 1, T, S]
        assert torch.equal(mask._materialize().expand_as(dense), dense)
    elif expected is None:
        assert mask is None
    else:
        assert not isinstance(mask, CausalBias) and torch.equal(mask, expected)


def test_generate_continues_from_a_chunked_prefill(model):
    """The cache `prefill_in_chunks` fills is the cache generate() continues: the greedy tokens of generate() over
    the whole prompt."""
    input_ids, attention_mask = prompts()
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, **GREEDY)
        cache = output_cache(prefill_in_chunks(model, input_ids[:, :-1], attention_mask[:, :-1], chunk_size=5))
        continued = model.generate(input_ids, attention_mask=attention_mask, **{CACHE_NAME: cache}, **GREEDY)
    assert torch.equal(continued, expected)


def test_prefill_in_chunks_continues_a_cache(model):
    """A second prompt segment prefilled on a cache that holds the first: the mask covers both segments."""
    input_ids, attention_mask = prompts()
    with torch.no_grad():
        whole = model(input_ids, attention_mask=attention_mask, logits_to_keep=1).logits
    first = prefill_in_chunks(model, input_ids[:, :9], attention_mask[:, :9], chunk_size=4)
    second = prefill_in_chunks(model, input_ids[:, 9:], attention_mask, cache=output_cache(first), chunk_size=4)
    torch.testing.assert_close(second.logits, whole, rtol=1e-4, atol=1e-5)


def test_scoring_in_chunks_gives_the_log_probs_of_one_forward(model):
    input_ids, attention_mask = prompts()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits.float()
    expected = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    expected = expected.masked_fill(attention_mask[:, 1:] == 0, 0.0)
    scores = score_in_chunks(model, input_ids, attention_mask, chunk_size=4)
    assert scores.shape == (2, 22) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_a_chunk_size_that_is_not_a_positive_count_is_refused(model, chunk_size):
    with pytest.raises(ValueError, match="chunk_size` must be a positive number of tokens"):
        prefill_in_chunks(model, prompts()[0], chunk_size=chunk_size)


def test_a_mask_that_does_not_cover_the_cached_and_new_tokens_is_refused(model):
    input_ids, attention_mask = prompts()
    cache = output_cache(prefill_in_chunks(model, input_ids[:, :9], chunk_size=4))
    with pytest.raises(ValueError, match=r"attention_mask` must be \[batch, cached \+ new tokens\] = \[2, 9 \+ 14\]"):
        prefill_in_chunks(model, input_ids[:, 9:], attention_mask[:, 9:], cache=cache, chunk_size=4)


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among the storages that ops allocate while the mode is on.

    Every op's outputs are seen; a storage an op's inputs already hold (a view, an in-place op) is not new. A storage
    is counted from the op that creates it until Python frees it (a finalizer on the storage object, which torch keeps
    alive as long as any tensor uses the storage). Tensors made before the mode (weights, the prompt) are not counted.
    """

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.tracked = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs))[0]
        inputs = {tensor.untyped_storage().data_ptr() for tensor in inputs if isinstance(tensor, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in inputs or id(storage) in self.tracked or storage.nbytes() == 0:
                continue
            self.tracked.add(id(storage))
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key, nbytes):
        self.tracked.discard(key)
        self.live -= nbytes


def prefill_peak_bytes(model, length, chunk_size):
    input_ids = torch.randint(1, 97, (1, length), generator=torch.Generator().manual_seed(0))
    with PeakLiveBytes() as memory:
        prefill_in_chunks(model, input_ids, chunk_size=chunk_size)
    return memory.peak


def test_chunked_prefill_activation_memory_does_not_grow_with_the_prompt():
    """Measure: the peak of the tensor bytes alive at once during the prefill, over everything its ops allocate
    (`PeakLiveBytes`: activations, the cache, temporaries).
    - pure KDA, chunks of 32 tokens: the same peak for a 64-, 160- and 256-token prompt (states of fixed size,
      activations of one chunk), where one forward over the prompt needs more and more (4x at 256 tokens already);
    - hybrid, chunks of 64 tokens: linear in the prompt (the same increment per added 64 tokens: the MLA latents, and
      the attention of a chunk's queries over them), where one forward's attention grows with the prompt's square."""
    pure_kda = tiny_model(seed=0, **LAYOUTS["pure_kda"])
    peaks = [prefill_peak_bytes(pure_kda, length, 32) for length in (64, 160, 256)]
    assert peaks[0] == peaks[1] == peaks[2]
    assert prefill_peak_bytes(pure_kda, 256, 256) > 4 * peaks[2]

    hybrid = tiny_model(seed=0)
    peaks = [prefill_peak_bytes(hybrid, length, 64) for length in (256, 320, 384)]
    assert 0 < peaks[1] - peaks[0] == pytest.approx(peaks[2] - peaks[1], rel=0.05), peaks
    assert prefill_peak_bytes(hybrid, 384, 384) > 4 * peaks[2]
