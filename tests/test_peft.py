"""PEFT LoRA with the recommended targets (examples/finetune.py): KDA / MLA projections, shared experts and the fused
routed experts (`target_parameters`) train; adapters save and reload; `merge_and_unload()` gives the same logits."""

import importlib.util
from pathlib import Path

import torch
from conftest import tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def finetune_example():
    spec = importlib.util.spec_from_file_location("kda_moe_finetune_example", EXAMPLES / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lora_model(seed=0):
    from peft import get_peft_model

    return get_peft_model(tiny_model(seed=seed).train(), finetune_example().lora_config(r=4, alpha=8))


def batches(vocab_size, steps):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab_size, (2, 16), generator=generator) for _ in range(steps)]


def test_lora_wraps_attention_projections_shared_and_routed_experts():
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import ParamWrapper

    model = lora_model()
    wrapped = {name.removeprefix("base_model.model."): module for name, module in model.named_modules()}
    layers = model.base_model.model.config.layer_types
    kda, mla = layers.index("linear_attention"), layers.index("full_attention")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj"):
        assert isinstance(wrapped[f"model.layers.{kda}.self_attn.{proj}"], LoraLinear), proj
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"):
        assert isinstance(wrapped[f"model.layers.{mla}.self_attn.{proj}"], LoraLinear), proj
    sparse = model.base_model.model.config.mlp_layer_types.index("sparse")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(wrapped[f"model.layers.{sparse}.mlp.shared_experts.{proj}"], LoraLinear), proj
    experts = wrapped[f"model.layers.{sparse}.mlp.experts"]
    assert isinstance(experts, ParamWrapper) and isinstance(experts.base_layer, ParamWrapper)
    assert {experts.parameter_name, experts.base_layer.parameter_name} == {"gate_up_proj", "down_proj"}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in name or ".gate.modules_to_save." in name for name in trainable), trainable


def test_lora_trains_saves_reloads_and_merges(tmp_path):
    from peft import PeftModel

    model = lora_model(seed=0)
    base_weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = batches(model.config.vocab_size, 6)
    losses = []
    for input_ids in data:
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # It trained: the loss on the (repeated) data fell, every adapter moved off its zero-initialised B, the base stayed.
    assert model(data[0], labels=data[0]).loss.item() < losses[0]
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert any(".mlp.experts." in n for n in lora_b) and all(torch.count_nonzero(p) > 0 for p in lora_b.values())
    for name, param in model.named_parameters():
        if name in base_weights:
            assert torch.equal(param, base_weights[name]), name

    model.eval()
    probe = torch.randint(1, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        adapter_logits = model(probe).logits
        with model.disable_adapter():
            plain_logits = model(probe).logits
    assert (adapter_logits - plain_logits).abs().max() > 1e-3

    # Save / reload on a fresh base model: the adapter (with the router's balancing biases) reproduces the logits.
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("gate.e_score_correction_bias") for k in saved)
    reloaded = PeftModel.from_pretrained(tiny_model(seed=0), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(probe).logits, adapter_logits, rtol=0, atol=1e-6)

    # Merging folds every update (Linear and fused-expert LoRA) into the weights: same logits, plain model back.
    merged = model.merge_and_unload()
    assert type(merged).__name__ == "KdaMoeForCausalLM"
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(probe).logits, adapter_logits, rtol=1e-5, atol=1e-5)
