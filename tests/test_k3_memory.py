"""benchmarks/k3_memory.py's arithmetic on tiny configs against direct counts: the parameters of a meta-device model,
and the tensors a forward keeps as decoder-layer inputs (what activation checkpointing keeps)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from kda_moe import KdaMoeForCausalLM


def load_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "k3_memory.py"
    spec = importlib.util.spec_from_file_location("k3_memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIGS = {
    "tiny": {},
    "other variants": dict(
        use_full_rank_gate=False, q_lora_rank=None, tie_word_embeddings=True, routed_expert_hidden_size=None,
        mla_use_output_gate=False, num_shared_experts=0, attn_res_block_size=3,
    ),  # fmt: skip
}


@pytest.mark.parametrize("overrides", list(CONFIGS.values()), ids=list(CONFIGS))
def test_parameter_counts_and_states_equal_a_meta_model(overrides):
    k3_memory = load_script()
    config = tiny_config(**overrides)
    with torch.device("meta"):
        model = KdaMoeForCausalLM(config)
    counts = k3_memory.parameter_counts(config)
    numel = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in numel.items() if ".experts." in name)
    layers = [
        (sum(p.numel() for name, p in layer.named_parameters() if ".experts." not in f".{name}"),
         sum(p.numel() for name, p in layer.named_parameters() if ".experts." in f".{name}"))
        for layer in model.model.layers
    ]  # fmt: skip
    largest = max(layers, key=sum)
    assert (counts.total, counts.experts) == (sum(numel.values()), experts)
    assert (counts.largest_layer_dense, counts.largest_layer_experts) == largest

    rows = k3_memory.memory_table(config, gpus=8, ep=4, stages={"short": (64, 2)})
    assert rows[0]["states"] == 16 * sum(numel.values()) / 8
    assert rows[0]["fsdp_buffers"] == 2 * (2 + 2) * (largest[0] + largest[1] / 4)
    assert (rows[0]["dp"], rows[0]["tokens_per_gpu"]) == (4, 32)


@pytest.mark.parametrize("overrides", list(CONFIGS.values()), ids=list(CONFIGS))
def test_checkpointed_bytes_equal_the_decoder_layer_inputs_of_a_forward(overrides):
    """The distinct storages passed into the decoder layers and the final AttnRes mix of a bf16 forward: the layer
    inputs and AttnRes block states activation checkpointing keeps."""
    k3_memory = load_script()
    config = tiny_config(**overrides)
    torch.manual_seed(0)
    model = KdaMoeForCausalLM(config).to(torch.bfloat16)
    storages = {}  # id -> storage, held so that no two of them share an id

    def record(module, args):
        for tensor in args:
            if isinstance(tensor, torch.Tensor):
                storages[id(tensor.untyped_storage())] = tensor.untyped_storage()

    for module in [*model.model.layers, model.model.out_res]:
        module.register_forward_pre_hook(record)
    with torch.no_grad():
        model(input_ids=torch.randint(1, config.vocab_size, (1, 24)))
    assert k3_memory.activation_bytes(config, 48, 2)["checkpointed"] == sum(s.nbytes() for s in storages.values())


def test_mesh_degrees_that_do_not_divide_are_refused():
    k3_memory = load_script()
    with pytest.raises(ValueError, match="ep=3 must divide"):
        k3_memory.memory_table(tiny_config(), gpus=8, ep=3)
    with pytest.raises(ValueError, match="cp=16 of stage 1M must divide gpus=8"):
        k3_memory.memory_table(tiny_config(), gpus=8, ep=4, stages={"1M": (1024, 16)})
