"""Packed sequences (`DataCollatorWithFlattening`: one row, position ids restarting at 0 per sequence) reach KDA
(state reset and no conv carry-over at each start, via cu_seqlens) and MLA (attention restricted to each sequence):
the packed batch gives the logits and the loss of the sequences run one by one."""

import pytest
import torch
from conftest import tiny_model

LENGTHS = (7, 13, 1, 5, 9)  # includes a 1-token sequence (no target of its own) and lengths < the conv kernel
LAYOUTS = {
    "hybrid": {},
    "kda_only": {"layer_types": ["linear_attention"] * 5},
    "mla_only": {"layer_types": ["full_attention"] * 5},
    "mla_rope": {"layer_types": ["linear_attention", "full_attention"] * 2 + ["full_attention"], "mla_use_nope": False},
}


def sequences(vocab_size, lengths=LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "position_ids+cu_seq_lens"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_loss_equals_the_sequences_run_separately(layout, flash_kwargs):
    from transformers import DataCollatorWithFlattening

    model = tiny_model(seed=0, **LAYOUTS[layout])
    seqs = sequences(model.config.vocab_size)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s} for s in seqs])
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(**batch)
        separate = [model(torch.tensor([s]), labels=torch.tensor([s])) for s in seqs]
    torch.testing.assert_close(packed.logits[0], torch.cat([out.logits[0] for out in separate]), rtol=1e-5, atol=1e-5)
    # Token-weighted mean of the separate losses (a sequence of n tokens scores n - 1 next-token predictions).
    weights = torch.tensor([n - 1 for n in LENGTHS], dtype=torch.float32)
    per_sequence = torch.stack([out.loss if n > 1 else torch.tensor(0.0) for out, n in zip(separate, LENGTHS)])
    torch.testing.assert_close(packed.loss, (per_sequence * weights).sum() / weights.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["hybrid", "kda_only", "mla_only"])
def test_nothing_leaks_from_one_packed_sequence_into_the_next(layout):
    """Changing every token of the first sequence leaves the later sequences' logits exactly as they were: no KDA
    state, no short-conv history and no MLA attention crosses a sequence start."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model(seed=0, **LAYOUTS[layout])
    seqs = sequences(model.config.vocab_size)
    changed = [sequences(model.config.vocab_size, LENGTHS[:1], seed=1)[0]] + seqs[1:]
    collator = DataCollatorWithFlattening()
    with torch.no_grad():
        a = model(**collator([{"input_ids": s} for s in seqs])).logits[0]
        b = model(**collator([{"input_ids": s} for s in changed])).logits[0]
    first = LENGTHS[0]
    assert (a[:first] - b[:first]).abs().max() > 1e-3  # the change is visible where it should be
    torch.testing.assert_close(a[first:], b[first:], rtol=0, atol=1e-6)


def test_packed_gradients_equal_the_separate_gradients():
    """Training on a packed batch is training on the sequences: same loss gradient for every weight."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model(seed=0, router_balancing="none")
    seqs = sequences(model.config.vocab_size)
    batch = DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    model(**batch).loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = sum(n - 1 for n in LENGTHS)
    for s in seqs:
        if len(s) > 1:
            (model(torch.tensor([s]), labels=torch.tensor([s])).loss * (len(s) - 1) / total).backward()
    for name, grad in packed.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)
