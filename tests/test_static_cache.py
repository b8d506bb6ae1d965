"""`generate(..., cache_implementation="static")`: a `KdaMoeStaticCache` whose tensors never move, and the decode step
compiled by transformers' automatic compile with `fullgraph=True` (CPU, fp32).

Compiling takes time on a CPU: each module-scoped model is compiled once per batch shape and reused. The compiled
greedy tokens are compared with eager greedy decoding on the default dynamic cache; on a GPU the same step is replayed
as a CUDA graph, which needs the fixed addresses checked here.
"""

import pytest
import torch
from conftest import tiny_model
from test_decoding import randomize_balancing_and_depth_mixing
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

from kda_moe import KdaMoeCache, KdaMoeStaticCache
from kda_moe.compat import CACHE_NAME, output_cache
from kda_moe.modeling.modeling_kda_moe import KdaMoeStaticLinearAttentionCacheLayer, layer_type_masks
from transformers.masking_utils import create_causal_mask

NEW_TOKENS = 6
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
LAYOUTS = {
    # every feature on; the routed experts on their eager loop, which compiled code swaps for gathered weights
    "hybrid": dict(experts_implementation="eager"),
    "pure_kda": dict(layer_types=["linear_attention"] * 5),
}


def compile_config(backend: str) -> CompileConfig:
    """transformers' automatic compile of the decode step, with `fullgraph=True` (a graph break raises), also on CPU."""
    config = CompileConfig(fullgraph=True, backend=backend, mode="default" if backend == "inductor" else None)
    config._compile_all_devices = True  # generate() compiles on GPUs only, unless told
    return config


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    return randomize_balancing_and_depth_mixing(tiny_model(seed=0, **LAYOUTS[request.param]))


def prompts(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 5 tokens; in a batch of 2 the second is left-padded to 3 tokens."""
    input_ids = torch.randint(1, 97, (batch_size, 5), generator=torch.Generator().manual_seed(batch_size))
    attention_mask = torch.ones_like(input_ids)
    if batch_size > 1:
        input_ids[1, :2], attention_mask[1, :2] = 0, 0
    return input_ids, attention_mask


def cache_tensors(cache: KdaMoeStaticCache) -> list[torch.Tensor]:
    """Every tensor a decode step reads or writes in the cache: KDA states and token counts, MLA latents and counts."""
    tensors = []
    for layer in cache.layers:
        if isinstance(layer, KdaMoeStaticLinearAttentionCacheLayer):
            tensors += [layer.conv_states[0], layer.recurrent_states[0], layer.tokens_seen]
        else:
            tensors += [layer.keys, layer.values, layer.cumulative_length]
    return tensors


def assert_one_token_count(cache: KdaMoeStaticCache, tokens: int) -> None:
    """The KDA layers share one count tensor (advanced once a forward, by the first of them), and it holds `tokens`."""
    layers = [layer for layer in cache.layers if isinstance(layer, KdaMoeStaticLinearAttentionCacheLayer)]
    assert all(layer.tokens_seen is layers[0].tokens_seen for layer in layers)
    assert [int(layer.get_seq_length()) for layer in layers] == [tokens] * len(layers)


class RecordCacheAddresses(LogitsProcessor):
    """Notes the addresses of the static cache's tensors after every forward of generate() (prefill and each step)."""

    def __init__(self):
        self.cache, self.addresses = None, []

    def __call__(self, input_ids, scores):
        self.addresses.append([tensor.data_ptr() for tensor in cache_tensors(self.cache)])
        return scores


def generate_static_compiled(model, input_ids, attention_mask, backend, monkeypatch):
    """Static + compiled greedy generate(): (tokens, graphs dynamo compiled, cache addresses per forward, the cache,
    its tensors' addresses when it was built)."""
    recorder, built = RecordCacheAddresses(), []
    prepare = model._prepare_static_cache

    def prepare_and_record(*args, **kwargs):
        recorder.cache = prepare(*args, **kwargs)
        built.append([tensor.data_ptr() for tensor in cache_tensors(recorder.cache)])
        return recorder.cache

    monkeypatch.setattr(model, "_prepare_static_cache", prepare_and_record)
    torch._dynamo.reset()  # graphs of earlier tests share the cache of `Module.__call__`'s code; start it empty
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        tokens = model.generate(
            input_ids,
            attention_mask=attention_mask,
            cache_implementation="static",
            compile_config=compile_config(backend),
            logits_processor=LogitsProcessorList([recorder]),
            **GREEDY,
        )
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    return tokens, graphs, recorder.addresses, recorder.cache, built[0]


@pytest.mark.parametrize("batch_size", [1, 2], ids=["batch1", "left_padded_batch2"])
def test_static_compiled_greedy_matches_eager_dynamic_greedy(model, batch_size, monkeypatch):
    """The compiled step gives eager greedy's tokens, traces to one graph (fullgraph=True: no graph break) that every
    step replays without recompiling, and the cache's tensors keep the addresses they were allocated at."""
    input_ids, attention_mask = prompts(batch_size)
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, **GREEDY)
    # inductor (C++ codegen, the slowest compile here) for the left-padded hybrid batch, aot_eager (the same captured
    # graph, functionalised, run op by op) elsewhere
    backend = "inductor" if batch_size == 2 and "full_attention" in model.config.layer_types else "aot_eager"
    tokens, graphs, addresses, cache, allocated = generate_static_compiled(
        model, input_ids, attention_mask, backend, monkeypatch
    )
    assert torch.equal(tokens, expected)
    assert graphs == 1  # the decode step, compiled at the first step and replayed by the other NEW_TOKENS - 2
    assert len(addresses) == NEW_TOKENS and all(step == allocated for step in addresses)
    assert int(cache.get_seq_length()) == input_ids.shape[1] + NEW_TOKENS - 1  # the last token is never fed back


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("new_tokens", [5, 1, 3], ids=["prefill", "step", "three_tokens"])
def test_static_cache_masks_equal_transformers_causal_masks(new_tokens, implementation):
    """The MLA mask that generate() builds for every step on a static cache, from the padding mask's shape, equals
    transformers' `create_causal_mask` (SDPA's boolean, eager's additive one) for a left-padded batch, on a fresh
    cache and on one holding tokens already."""
    model = tiny_model(seed=0, attn_implementation=implementation)
    config = model.config
    cached = 5 - new_tokens if new_tokens < 5 else 0
    input_ids, attention_mask = prompts(2)
    input_ids = torch.cat([input_ids, input_ids[:, -1:].repeat(1, 3)], dim=1)[:, : cached + new_tokens]
    attention_mask = torch.cat([attention_mask, attention_mask[:, -1:].repeat(1, 3)], dim=1)[:, : cached + new_tokens]
    cache = KdaMoeStaticCache(config, max_cache_len=11, batch_size=2, dtype=torch.float32, device="cpu")
    if cached:
        with torch.no_grad():
            model(input_ids[:, :cached], attention_mask=attention_mask[:, :cached], **{CACHE_NAME: cache})
    shape_only = torch.empty(2, new_tokens, 0)
    ours = layer_type_masks(config, shape_only, attention_mask, cache, position_ids=None)["full_attention"]
    theirs = create_causal_mask(config, shape_only, attention_mask, cache, position_ids=None)
    assert ours.shape == (2, 1, new_tokens, 11) and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)


def test_generate_allocates_the_static_cache_for_batch_and_max_length(model):
    """generate() builds a `KdaMoeStaticCache` with every tensor allocated for the batch and max length: KDA conv
    states [B, 3 * H * K, W-1] and fp32 recurrent states [B, H, K, K], MLA latents [B, 1, S, kv_lora_rank] and rotary
    keys [B, 1, S, qk_rope_head_dim]."""
    config = model.config
    input_ids, attention_mask = prompts(2)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, cache_implementation="static",
                             return_dict_in_generate=True, **GREEDY)
    cache = output_cache(out)
    assert isinstance(cache, KdaMoeStaticCache) and cache.is_compileable
    heads, head_dim, width = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    max_length = cache.get_max_length()  # the longest generate() of this model asked for
    assert max_length < 0 or max_length >= input_ids.shape[1] + NEW_TOKENS - 1  # < 0: no MLA layer, no length
    for layer_type, layer in zip(config.layer_types, cache.layers):
        if layer_type == "linear_attention":
            assert layer.conv_states[0].shape == (2, 3 * heads * head_dim, width - 1)
            assert layer.recurrent_states[0].shape == (2, heads, head_dim, head_dim)
            assert layer.recurrent_states[0].dtype == torch.float32
        else:
            assert layer.keys.shape == (2, 1, max_length, config.kv_lora_rank)
            assert layer.values.shape == (2, 1, max_length, config.qk_rope_head_dim)
    assert_one_token_count(cache, input_ids.shape[1] + NEW_TOKENS - 1)  # the last token is never fed back


def test_static_kda_layers_reserve_the_arrival_counters_with_their_states(model, monkeypatch):
    """Each KDA layer of a static cache reserves the decoding kernels' arrival counters, at least one for each of its
    B x H heads, when it allocates its states: before any step is compiled or captured, so that none is allocated
    inside a CUDA graph's pool."""
    import kda_moe.modeling.modeling_kda_moe as modeling

    reserved = []
    monkeypatch.setattr(modeling, "reserve_arrival_counters", lambda device, groups: reserved.append((device, groups)))
    input_ids, attention_mask = prompts(2)
    with torch.no_grad():
        model.generate(input_ids, attention_mask=attention_mask, cache_implementation="static", **GREEDY)
    kda_layers = model.config.layer_types.count("linear_attention")
    assert reserved == [(input_ids.device, 2 * model.config.linear_num_heads)] * kda_layers


def test_a_static_cache_built_by_the_caller_allocates_at_the_first_forward(model):
    """`KdaMoeStaticCache(config, max_cache_len)` without a batch size allocates each layer's tensors at the prefill,
    on the device and in the dtype of the layer's own activations (a model spread over several devices)."""
    input_ids, attention_mask = prompts(2)
    cache = KdaMoeStaticCache(model.config, max_cache_len=16)
    assert all(tensor is None for tensor in cache_tensors(cache)[:2])
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, **GREEDY)
        tokens = model.generate(input_ids, attention_mask=attention_mask, **{CACHE_NAME: cache}, **GREEDY)
    assert torch.equal(tokens, expected)
    assert all(tensor.shape[0] == 2 for tensor in cache_tensors(cache) if tensor.dim() > 0)
    assert_one_token_count(cache, input_ids.shape[1] + NEW_TOKENS - 1)


def test_static_cache_matches_the_dynamic_one_in_beam_search_and_sampling(model):
    """Beam search reorders the static KDA states in place; sampling draws the same tokens from the same seed."""
    input_ids, attention_mask = prompts(2)
    with torch.no_grad():
        results = []
        for implementation in (None, "static"):
            options = dict(attention_mask=attention_mask, cache_implementation=implementation, **GREEDY)
            beams = model.generate(input_ids, num_beams=3, **options)
            torch.manual_seed(0)
            sampled = model.generate(input_ids, **{**options, "do_sample": True, "top_k": 5})
            results.append((beams, sampled))
    for dynamic, static in zip(*results):
        assert torch.equal(dynamic, static)


def test_a_static_cache_continues_generation_and_refuses_tokens_beyond_its_length(model):
    """A static cache returned by generate() continues the sequence like one generate() call; a forward past its
    `max_cache_len` raises a ValueError naming the fix instead of an index error inside an MLA layer."""
    input_ids, _ = prompts(1)
    with torch.no_grad():
        at_once = model.generate(input_ids, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        first = model.generate(input_ids, cache_implementation="static", max_cache_len=16,
                               return_dict_in_generate=True, **GREEDY)
        cache = output_cache(first)
        continued = model.generate(first.sequences, **{CACHE_NAME: cache}, max_new_tokens=3, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        assert torch.equal(continued, at_once)
        if "full_attention" in model.config.layer_types:  # only MLA latents need a position per token
            with pytest.raises(ValueError, match="no room for 8 more.*max_cache_len"):
                model(continued[:, -8:], **{CACHE_NAME: cache})


def test_assisted_and_prompt_lookup_decoding_refuse_a_static_cache(model):
    """Rolling rejected drafts back needs the KDA states of past tokens, which only the dynamic cache records."""
    input_ids, _ = prompts(1)
    draft = tiny_model(seed=1, layer_types=model.config.layer_types)
    for drafting in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=2)):
        with pytest.raises(ValueError, match="needs a KdaMoeCache.*no `cache_implementation`"):
            model.generate(input_ids, cache_implementation="static", **drafting, **GREEDY)


def test_generate_compiles_the_decode_step_with_fullgraph_by_default(model):
    """On a GPU generate() compiles the static-cache step with the model's default settings: transformers' (inductor,
    "reduce-overhead", i.e. CUDA graphs) with fullgraph=True. The dynamic cache is never compiled."""
    default = model._default_compile_config()
    assert default.fullgraph and default.mode == "reduce-overhead"
    assert KdaMoeStaticCache(model.config, max_cache_len=8).is_compileable
    assert not KdaMoeCache(model.config).is_compileable


def test_static_decode_through_the_triton_kernels_compiles_to_our_custom_ops():
    """With the Triton backend (on a GPU, or in the interpreter) the compiled step holds our decode kernels as custom
    ops (their states updated in place, no chunked kernel) and gives the tokens of eager dynamic decoding."""
    from torch._dynamo.backends.common import aot_autograd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(seed=0, kernel_backend="triton", linear_head_dim=16, num_hidden_layers=3,
                       layer_types=["linear_attention", "linear_attention", "full_attention"]).to(device)
    graph_ops = []

    def record(gm, example_inputs):  # an in-place op shows as auto_functionalized(op, ...)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        graph_ops.append({str(n.args[0] if "auto_functionalized" in str(n.target) else n.target) for n in calls})
        return gm

    input_ids, attention_mask = (t.to(device) for t in prompts(2))
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, **GREEDY)
        config = compile_config(aot_autograd(fw_compiler=record))
        tokens = model.generate(input_ids, attention_mask=attention_mask, cache_implementation="static",
                                compile_config=config, **GREEDY)
    assert torch.equal(tokens, expected)
    assert len(graph_ops) == 1
    decode_kernels = {op for op in graph_ops[0] if op.startswith("kda_moe.") and "decode_step" in op}
    assert decode_kernels and not any("chunk" in op for op in graph_ops[0])


def test_multimodal_model_decodes_an_image_prompt_through_the_compiled_static_step():
    """The image is encoded at the (eager) prefill; the compiled step of the vision-language model is one graph
    that gives the tokens of eager decoding on the dynamic cache."""
    from multimodal_testing import random_image, tiny_multimodal_model, tiny_processor
    from test_multimodal_generation import chat_inputs

    model = tiny_multimodal_model(seed=0)
    inputs = chat_inputs(tiny_processor(model), [random_image(23, 37)])
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        expected = model.generate(**inputs, **GREEDY)
        tokens = model.generate(**inputs, cache_implementation="static", compile_config=compile_config("aot_eager"),
                                **GREEDY)
    assert torch.equal(tokens, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
