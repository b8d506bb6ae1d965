"""Cache, incremental decoding, padding and generate() behaviour of KdaMoeForCausalLM (CPU, fp32; one test bf16)."""

import copy

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, GenerationConfig

from kda_moe.compat import CACHE_NAME, output_cache


def randomize_balancing_and_depth_mixing(model, seed=1):
    """Non-zero AttnRes pseudo-queries and router biases, so the tests see non-uniform depth mixing and biased
    expert selection (both start at zero after init)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("res.proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def full_model():
    return randomize_balancing_and_depth_mixing(tiny_model(seed=0))


def decode_in_chunks(model, input_ids, chunks):
    cache = DynamicCache(config=model.config)
    logits, start = [], 0
    for size in chunks:
        out = model(input_ids[:, start : start + size], cache=cache, use_cache=True)
        cache = output_cache(out)
        logits.append(out.logits)
        start += size
    assert start == input_ids.shape[1]
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("chunks", [[1] * 13, [3, 1, 5, 2, 1, 1]], ids=["token_by_token", "uneven_chunks"])
def test_incremental_decoding_matches_full_forward(full_model, chunks):
    config = full_model.config
    assert config.gate_lower_bound is not None and config.mla_use_output_gate and config.attn_res_block_size
    assert config.hidden_act == "situ" and config.router_balancing == "quantile" and config.latent_moe_use_norm
    input_ids = torch.randint(1, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = full_model(input_ids).logits
        stepped = decode_in_chunks(full_model, input_ids, chunks)
    assert (stepped - full).abs().max() < 1e-4


def test_bf16_model_decodes_token_by_token_on_cpu(full_model):
    """A bf16 model decodes through the PyTorch reference: the KDA decode step keeps the activations' dtype (its fp32
    state must not turn the layer's output fp32, which the bf16 output projection rejects) and follows the full
    forward. bf16 logits: 2e-2 relative, the rounding of ~8 bits through a few layers on both paths."""
    model = copy.deepcopy(full_model).to(torch.bfloat16)
    input_ids = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids).logits.float()
        stepped = decode_in_chunks(model, input_ids, [5] + [1] * 4)
        generated = model.generate(input_ids, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert stepped.dtype == torch.bfloat16 and generated.shape == (2, 12)
    assert ((stepped.float() - full).norm() / full.norm()).item() < 2e-2


def test_absorbed_mla_decoding_reads_only_the_latent_cache(full_model):
    """The MLA cache holds kv_lora_rank + rope dims per token, one 'head' shared by all heads."""
    config = full_model.config
    input_ids = torch.randint(1, config.vocab_size, (1, 6))
    with torch.no_grad():
        cache = output_cache(full_model(input_ids, use_cache=True))
    mla_layer = config.layer_types.index("full_attention")
    keys, values = cache.layers[mla_layer].keys, cache.layers[mla_layer].values
    assert keys.shape == (1, 1, 6, config.kv_lora_rank)
    assert values.shape == (1, 1, 6, config.qk_rope_head_dim)


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
def test_left_padding_matches_unpadded(rope):
    model = randomize_balancing_and_depth_mixing(tiny_model(seed=2, mla_use_nope=not rope))
    generator = torch.Generator().manual_seed(3)
    long = torch.randint(3, model.config.vocab_size, (1, 9), generator=generator)
    short = torch.randint(3, model.config.vocab_size, (1, 5), generator=generator)
    pad = model.config.pad_token_id
    batch = torch.cat([long, torch.cat([torch.full((1, 4), pad), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    generation = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=pad, eos_token_id=None)
    with torch.no_grad():
        batched_logits = model(batch, attention_mask=mask).logits
        assert (batched_logits[0] - model(long).logits[0]).abs().max() < 1e-4
        assert (batched_logits[1, 4:] - model(short).logits[0]).abs().max() < 1e-4
        batched = model.generate(batch, attention_mask=mask, generation_config=generation)
        alone_long = model.generate(long, generation_config=generation)
        alone_short = model.generate(short, generation_config=generation)
    assert torch.equal(batched[0], alone_long[0])
    assert torch.equal(batched[1, 4:], alone_short[0])


def test_greedy_generate_matches_argmax_loop(full_model):
    input_ids = torch.randint(1, full_model.config.vocab_size, (2, 4))
    generation = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        generated = full_model.generate(input_ids, generation_config=generation)
        ids = input_ids
        for _ in range(6):
            ids = torch.cat([ids, full_model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)


def test_sampling_and_beam_search_generate(full_model):
    input_ids = torch.randint(1, full_model.config.vocab_size, (2, 4))
    with torch.no_grad():
        torch.manual_seed(0)
        sampled = full_model.generate(input_ids, do_sample=True, top_k=5, max_new_tokens=5, eos_token_id=None)
        torch.manual_seed(0)
        resampled = full_model.generate(input_ids, do_sample=True, top_k=5, max_new_tokens=5, eos_token_id=None)
        beams = full_model.generate(input_ids, num_beams=3, max_new_tokens=5, eos_token_id=None, do_sample=False)
        # One beam is greedy search.
        one_beam = full_model.generate(input_ids, num_beams=1, max_new_tokens=5, eos_token_id=None, do_sample=False)
        greedy = full_model.generate(input_ids, max_new_tokens=5, eos_token_id=None, do_sample=False)
    assert sampled.shape == beams.shape == (2, 9)
    assert torch.equal(sampled, resampled)
    assert torch.equal(one_beam, greedy)
    # Beam search must score its best beam at least as well as greedy under the model's own log-probabilities.
    def sequence_logprob(ids):
        with torch.no_grad():
            logprobs = full_model(ids).logits[:, 3:-1].log_softmax(-1)
        return logprobs.gather(-1, ids[:, 4:, None]).sum((1, 2))

    assert (sequence_logprob(beams) >= sequence_logprob(greedy) - 1e-4).all()


def test_generate_continues_from_returned_cache(full_model):
    input_ids = torch.randint(1, full_model.config.vocab_size, (2, 5))
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        first = full_model.generate(input_ids, max_new_tokens=4, return_dict_in_generate=True, **kwargs)
        cache = output_cache(first)
        assert cache is not None
        continued = full_model.generate(first.sequences, max_new_tokens=3, **{CACHE_NAME: cache}, **kwargs)
        at_once = full_model.generate(input_ids, max_new_tokens=7, **kwargs)
    assert torch.equal(continued, at_once)


def test_text_generation_pipeline_runs(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, pipeline

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=97, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    model = tiny_model(seed=0, vocab_size=len(fast))
    generator = pipeline("text-generation", model=model, tokenizer=fast, device="cpu")
    result = generator("the quick", max_new_tokens=5, do_sample=False)
    assert result[0]["generated_text"].startswith("the quick")
    assert len(fast(result[0]["generated_text"])["input_ids"]) > len(fast("the quick")["input_ids"])


def test_packed_row_matches_sequences_run_separately(full_model):
    """position_ids restarting at 0 pack sequences into one row: KDA state and conv reset, MLA stays inside each."""
    generator = torch.Generator().manual_seed(7)
    pieces = [torch.randint(1, full_model.config.vocab_size, (1, n), generator=generator) for n in (7, 1, 5)]
    packed = torch.cat(pieces, dim=1)
    position_ids = torch.cat([torch.arange(p.shape[1]) for p in pieces])[None]
    with torch.no_grad():
        out = full_model(packed, position_ids=position_ids)
        assert output_cache(out) is None
        start = 0
        for piece in pieces:
            alone = full_model(piece).logits
            assert (out.logits[:, start : start + piece.shape[1]] - alone).abs().max() < 1e-5
            start += piece.shape[1]
        with pytest.raises(ValueError, match="packed sequences cannot use a cache"):
            full_model(packed, position_ids=position_ids, cache=DynamicCache(config=full_model.config))


def test_pure_kda_model_decodes_through_its_cache():
    model = tiny_model(seed=0, layer_types=["linear_attention"] * 5)
    input_ids = torch.randint(1, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(input_ids).logits
        stepped = decode_in_chunks(model, input_ids, [4, 1, 1, 3])
    assert (stepped - full).abs().max() < 1e-4


def test_continuous_batching_is_refused_with_the_padded_generate_alternative(full_model):
    with pytest.raises(NotImplementedError, match=r"continuous batching.*padded batch"):
        full_model.generate_batch([[5, 6, 7], [8, 9]])
    with pytest.raises(NotImplementedError, match=r"continuous batching.*padded batch"):
        full_model.generate(torch.tensor([[5, 6, 7]]), cache_implementation="paged", max_new_tokens=2)
