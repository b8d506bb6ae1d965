"""Greedy decoding on a compiled static cache in blocks of steps (`modeling/graphed_decoding.py`): the tokens of
transformers' step-by-step loop, whatever the block size, the padding and where rows finish.

On a CPU the blocks run step by step through the compiled forward (aot_eager: the graph dynamo captures, op by op);
on a GPU each block is one CUDA-graph replay, checked against transformers' own compiled loop.
"""

import pytest
import torch
from conftest import tiny_model
from test_decoding import randomize_balancing_and_depth_mixing
from test_static_cache import LAYOUTS, compile_config, prompts
from transformers import LogitsProcessorList, MinLengthLogitsProcessor

import kda_moe.modeling.modeling_kda_moe as modeling

GREEDY = dict(max_new_tokens=11, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, **LAYOUTS[request.param]))
    model.generation_config.decode_steps_per_graph = 4  # 11 tokens: the prefill's, two blocks of 4, then 2 more
    return model


def graphed_generate(model, input_ids, attention_mask, **kwargs):
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=attention_mask,
            cache_implementation="static",
            compile_config=compile_config("aot_eager"),
            **{**GREEDY, **kwargs},
        )


def count_graphed_calls(monkeypatch) -> list:
    calls = []
    decode = modeling.greedy_decoding
    monkeypatch.setattr(modeling, "greedy_decoding", lambda *args, **kwargs: calls.append(1) or decode(*args, **kwargs))
    return calls


@pytest.mark.parametrize("ends", ["none", "one_row", "every_row"])
def test_graphed_greedy_gives_the_step_by_step_tokens(model, ends, monkeypatch):
    """Left-padded batch of 2: no end token (11 tokens), an end token that one row produces (the other row goes
    on, the finished one gets pad tokens), end tokens that finish both rows early (the output stops where the later
    row finished, as transformers' loop does)."""
    input_ids, attention_mask = prompts(2)
    with torch.no_grad():
        free = model.generate(input_ids, attention_mask=attention_mask, eos_token_id=None, **GREEDY)
    new = free[:, input_ids.shape[1] :]
    # one_row: a token row 0 makes after a few steps, and row 1 never
    only_row_0 = next(int(t) for i, t in enumerate(new[0]) if i >= 2 and t not in new[1] and t not in new[0, :i])
    eos_token_id = {"none": None, "one_row": only_row_0, "every_row": [int(new[0, 2]), int(new[1, 6])]}[ends]
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, eos_token_id=eos_token_id, **GREEDY)
    calls = count_graphed_calls(monkeypatch)
    tokens = graphed_generate(model, input_ids, attention_mask, eos_token_id=eos_token_id)
    assert calls == [1]
    assert torch.equal(tokens, expected)
    if ends == "every_row":
        assert tokens.shape[1] < free.shape[1]


def test_a_later_call_reuses_the_decoder_and_its_cache_and_blocks_run_past_the_end(model):
    """The cache is a block longer than the tokens (a block may run past the last one: its extra tokens are cut); a
    second call with the same batch size gets the same decoder and cache again (on a GPU: no new capture), another
    batch size a new one."""
    input_ids, attention_mask = prompts(2)
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, eos_token_id=None, **GREEDY)
    first = graphed_generate(model, input_ids, attention_mask, eos_token_id=None)
    decoder = model._graphed_decoder
    cache_length = decoder.cache.get_max_length()
    if cache_length >= 0:  # MLA layers: the prompt, the new tokens and a block
        assert cache_length >= input_ids.shape[1] + GREEDY["max_new_tokens"] + 4 - 1
    again = graphed_generate(model, input_ids, attention_mask, eos_token_id=None)
    assert model._graphed_decoder is decoder
    assert torch.equal(first, expected) and torch.equal(again, expected)
    graphed_generate(model, *prompts(1), eos_token_id=None)
    assert model._graphed_decoder is not decoder


def test_decoding_stops_one_block_after_every_row_finished(model):
    """The host reads a block's unfinished flag while the next block runs: once both rows have produced an end token,
    at most one more block runs, not the rest of `max_new_tokens`, and the tokens are still transformers'."""
    input_ids, attention_mask = prompts(2)
    long = dict(GREEDY, max_new_tokens=40)  # 1 from the prefill, then blocks of 4
    with torch.no_grad():
        free = model.generate(input_ids, attention_mask=attention_mask, **dict(long, eos_token_id=None))
    new = free[:, input_ids.shape[1] :]
    eos_token_id = [int(new[0, 2]), int(new[1, 3])]
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, **dict(long, eos_token_id=eos_token_id))
    tokens = graphed_generate(model, input_ids, attention_mask, max_new_tokens=40, eos_token_id=eos_token_id)
    assert torch.equal(tokens, expected)
    finished = expected.shape[1] - input_ids.shape[1]  # the tokens up to the later row's end token
    steps_run = int(model._graphed_decoder.state.cache_position) - input_ids.shape[1]  # one per token fed back
    assert finished <= steps_run + 1 <= finished + 2 * 4, (finished, steps_run)


def test_batch_of_one_graphed_greedy_gives_the_step_by_step_tokens(model):
    input_ids, attention_mask = prompts(1)
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, eos_token_id=None, **GREEDY)
    assert torch.equal(graphed_generate(model, input_ids, attention_mask, eos_token_id=None), expected)


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=True, top_k=5),
        dict(logits_processor=LogitsProcessorList([MinLengthLogitsProcessor(9, eos_token_id=3)])),
        dict(return_dict_in_generate=True),
        dict(decode_steps_per_graph=None),
        dict(decode_steps_per_graph="unset"),
    ],
    ids=["sampling", "logits_processor", "return_dict", "turned_off", "unset"],
)
def test_other_decoding_keeps_transformers_loop(model, options, monkeypatch):
    """Sampling, logits processors and a returned cache (which would hold the steps run past the end) go through
    transformers' loop, as does `decode_steps_per_graph` None, or unset off a GPU."""
    input_ids, attention_mask = prompts(2)
    options = dict(options)  # the parameter is shared by both models
    steps = options.pop("decode_steps_per_graph", 4)
    if steps == "unset":
        monkeypatch.delattr(model.generation_config, "decode_steps_per_graph")
    else:
        monkeypatch.setattr(model.generation_config, "decode_steps_per_graph", steps)
    calls = count_graphed_calls(monkeypatch)
    torch._dynamo.reset()  # on a GPU transformers compiles its step: start below the recompile limit earlier tests used
    graphed_generate(model, input_ids, attention_mask, eos_token_id=None, **options)
    assert calls == []


def test_unset_block_length_is_sixteen_steps_on_a_gpu_only():
    """Unset, `decode_steps_per_graph` is `DECODE_STEPS_PER_GRAPH` (16) on a CUDA device and transformers' loop on
    others; set, it is what it says on every device."""
    from transformers import GenerationConfig

    from kda_moe.modeling.graphed_decoding import DECODE_STEPS_PER_GRAPH, decode_steps_per_graph

    unset, cuda, cpu = GenerationConfig(), torch.device("cuda", 0), torch.device("cpu")
    assert not hasattr(unset, "decode_steps_per_graph")
    assert decode_steps_per_graph(unset, cuda) == DECODE_STEPS_PER_GRAPH == 16
    assert decode_steps_per_graph(unset, cpu) is None
    for steps in (None, 4):
        config = GenerationConfig(decode_steps_per_graph=steps)
        assert decode_steps_per_graph(config, cuda) == decode_steps_per_graph(config, cpu) == steps


@pytest.mark.parametrize("steps", [0, True, "4"])
def test_decode_steps_per_graph_must_be_a_positive_count(model, steps, monkeypatch):
    monkeypatch.setattr(model.generation_config, "decode_steps_per_graph", steps)
    with pytest.raises(ValueError, match="decode_steps_per_graph must be a positive number"):
        graphed_generate(model, *prompts(1), eos_token_id=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch_size", [1, 2])
def test_blocks_replayed_as_cuda_graphs_give_transformers_compiled_tokens(batch_size):
    """On a GPU (Triton kernels, fp32): blocks of 4 steps as CUDA graphs against transformers' compiled loop
    (inductor, its own CUDA graphs, one step at a time) on the same model, with an end token one row produces."""
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=0, kernel_backend="triton", linear_head_dim=16)).cuda()
    input_ids, attention_mask = (tensor.cuda() for tensor in prompts(batch_size))
    settings = dict(attention_mask=attention_mask, cache_implementation="static", **GREEDY)
    torch._dynamo.reset()  # earlier tests' graphs share the recompile limit of `Module.__call__`'s code; start empty
    with torch.no_grad():
        model.generation_config.decode_steps_per_graph = None
        free = model.generate(input_ids, eos_token_id=None, **settings)
        eos_token_id = int(free[0, input_ids.shape[1] + 5])
        expected = model.generate(input_ids, eos_token_id=eos_token_id, **settings)
        model.generation_config.decode_steps_per_graph = 4
        tokens = model.generate(input_ids, eos_token_id=eos_token_id, **settings)
    assert torch.equal(tokens, expected)
