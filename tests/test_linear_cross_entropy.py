"""The chunked linear cross-entropy (`kernels.loss.linear_cross_entropy`) against transformers' causal LM loss on the
built logits, and the models' training forward that uses it: same loss and gradients, no [tokens, vocab] logits."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch.overrides import TorchFunctionMode
from transformers.loss.loss_utils import ForCausalLMLoss

from kda_moe.kernels.loss import linear_cross_entropy

VOCAB, WIDTH = 50, 16


def inputs(batch=3, length=7, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, WIDTH, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=generator, dtype=dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, length), generator=generator)
    labels[0, :3] = -100  # a prompt whose tokens carry no loss
    return hidden, weight, labels


def loss_and_grads(loss_fn, hidden, weight):
    loss = loss_fn()
    return (loss.detach(), *torch.autograd.grad(3.0 * loss, (hidden, weight)))


@pytest.mark.parametrize("chunk_elements", [VOCAB, 4 * VOCAB, 10**6])  # 1 token, 4 (not dividing 21), all
@pytest.mark.parametrize("num_items_in_batch", [None, 11])
def test_loss_and_gradients_equal_transformers_loss_on_the_logits(chunk_elements, num_items_in_batch):
    hidden, weight, labels = inputs()
    expected = loss_and_grads(
        lambda: ForCausalLMLoss(F.linear(hidden, weight), labels, VOCAB, num_items_in_batch=num_items_in_batch),
        hidden, weight,
    )  # fmt: skip
    got = loss_and_grads(
        lambda: linear_cross_entropy(
            hidden, weight, labels, num_items_in_batch=num_items_in_batch, chunk_elements=chunk_elements
        ),
        hidden, weight,
    )  # fmt: skip
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_shift_labels_and_ignore_index_are_read_as_transformers_reads_them():
    hidden, weight, labels = inputs(seed=1)
    shifted = F.pad(labels.clamp_min(0), (0, 1), value=-1)[:, 1:].contiguous()
    shifted[1, 2] = -1
    expected = ForCausalLMLoss(F.linear(hidden, weight), None, VOCAB, ignore_index=-1, shift_labels=shifted)
    got = linear_cross_entropy(hidden, weight, shift_labels=shifted, ignore_index=-1, chunk_elements=2 * VOCAB)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_keeps_the_bf16_products_error():
    """Under bf16 autocast the head's products run in bf16 as in the logits path. Against the fp32 truth the loss
    differs by the bf16 logits' rounding (2^-8 relative per logit, averaged over tokens), and the gradients by the
    bf16 rounding of d loss / d logits and of each chunk's product: 2^-7 relative bounds both paths' errors here, and
    the chunked path must not be worse than the logits path's by more than that."""
    hidden, weight, labels = inputs(batch=4, length=32, seed=2)
    truth = loss_and_grads(lambda: ForCausalLMLoss(F.linear(hidden, weight), labels, VOCAB), hidden, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits_path = loss_and_grads(lambda: ForCausalLMLoss(F.linear(hidden, weight), labels, VOCAB), hidden, weight)
        chunked = loss_and_grads(lambda: linear_cross_entropy(hidden, weight, labels, chunk_elements=8 * VOCAB),
                                 hidden, weight)  # fmt: skip
    for c, l, t in zip(chunked, logits_path, truth):
        assert c.dtype == t.dtype
        error, reference_error = ((c - t).norm() / t.norm()).item(), ((l - t).norm() / t.norm()).item()
        assert error < 2**-7 and error < reference_error + 2**-7, (error, reference_error)


class LargestVocabTensor(TorchFunctionMode):
    """Records the largest tensor with a last dimension of `VOCAB` that any torch function returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.ndim == 2 and tensor.shape[-1] == VOCAB:
                self.largest = max(self.largest, tensor.shape[0])
        return out


def test_no_more_than_a_chunk_of_logits_exists_in_forward_or_backward():
    hidden, weight, labels = inputs(batch=4, length=16, seed=3)
    with LargestVocabTensor() as recorder:
        linear_cross_entropy(hidden, weight, labels, chunk_elements=5 * VOCAB).backward()
    assert recorder.largest == 5  # rows of logits (or of their gradient) at once, of the 64 tokens


def test_bad_inputs_name_the_problem():
    hidden, weight, labels = inputs()
    with pytest.raises(ValueError, match="exactly one"):
        linear_cross_entropy(hidden, weight)
    with pytest.raises(ValueError, match="share d"):
        linear_cross_entropy(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="one entry per position"):
        linear_cross_entropy(hidden, weight, labels[:, :-1])


def one_training_step(model, **batch):
    """The outputs of one training forward and the gradient of every parameter after its backward."""
    model.train()
    outputs = model(**batch)
    outputs.loss.backward()
    return outputs, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def training_batch(packed, vocab_size):
    """Two rows whose first 4 tokens carry no loss, or (packed) three documents in one row as
    `DataCollatorWithFlattening` builds it (position ids restarting at 0, no target across documents)."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(4)
    if packed:
        documents = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in (9, 5, 10)]
        return DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in documents])
    input_ids = torch.randint(1, vocab_size, (2, 12), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(torch.arange(12) < 4, -100)}


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_training_forward_with_labels_skips_the_logits_and_keeps_loss_and_gradients(packed):
    fused = tiny_model(seed=4)
    plain = copy.deepcopy(fused)
    plain.config.fused_linear_cross_entropy = False
    batch = training_batch(packed, fused.config.vocab_size)
    got, got_grads = one_training_step(fused, **batch, num_items_in_batch=torch.tensor(13))
    expected, expected_grads = one_training_step(plain, **batch, num_items_in_batch=torch.tensor(13))
    assert got.logits is None and expected.logits.shape == (*batch["input_ids"].shape, fused.config.vocab_size)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    for name, buffer in plain.named_buffers():  # the routers balanced on the same statistics
        torch.testing.assert_close(fused.get_buffer(name), buffer, rtol=0, atol=0, msg=name)


def test_logits_come_back_outside_training_without_labels_and_on_an_adapted_head():
    model = tiny_model(seed=5)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 6))
    vocab = model.config.vocab_size
    assert model.eval()(input_ids, labels=input_ids).logits.shape == (1, 6, vocab)  # evaluation: logits for metrics
    assert model.train()(input_ids).logits.shape == (1, 6, vocab)
    with torch.no_grad():
        assert model(input_ids, labels=input_ids).logits.shape == (1, 6, vocab)
    model.lm_head.register_forward_hook(lambda module, args, output: output * 2)  # a hook: the head is not plain
    hooked = model(input_ids, labels=input_ids)
    assert hooked.logits.shape == (1, 6, vocab)
    torch.testing.assert_close(hooked.loss, ForCausalLMLoss(hooked.logits, input_ids, vocab))


def test_multimodal_training_forward_uses_the_chunked_loss_too():
    from multimodal_testing import tiny_multimodal_model

    fused = tiny_multimodal_model(seed=6)
    plain = copy.deepcopy(fused)
    plain.config.text_config.fused_linear_cross_entropy = False
    input_ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(6))
    got, got_grads = one_training_step(fused, input_ids=input_ids, labels=input_ids)
    expected, expected_grads = one_training_step(plain, input_ids=input_ids, labels=input_ids)
    assert got.logits is None and expected.logits is not None
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
