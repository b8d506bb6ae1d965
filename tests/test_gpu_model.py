"""The whole model on a CUDA device through the Triton kernels, against the PyTorch backend (skipped without CUDA)."""

import pytest
import torch
from conftest import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Triton KDA tiles need power-of-two head dims >= 16.
GPU_SHAPES = dict(hidden_size=128, linear_num_heads=2, linear_head_dim=64, routed_expert_hidden_size=64)


def pair(**overrides):
    """The same weights twice: one model on the Triton backend, one on the PyTorch reference, both on CUDA."""
    triton_model = tiny_model(seed=0, kernel_backend="triton", **GPU_SHAPES, **overrides).cuda()
    torch_model = tiny_model(seed=0, kernel_backend="torch", **GPU_SHAPES, **overrides).cuda()
    torch_model.load_state_dict(triton_model.state_dict())
    return triton_model, torch_model


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_triton_forward_and_decoding_match_torch_backend_fp32(lower_bound):
    triton_model, torch_model = pair(gate_lower_bound=lower_bound)
    input_ids = torch.randint(1, triton_model.config.vocab_size, (2, 77), device="cuda")
    with torch.no_grad():
        expected = torch_model(input_ids).logits
        actual = triton_model(input_ids).logits
        # tf32 tensor-core products inside the kernels: compare relative to the logits' scale
        assert (actual - expected).norm() / expected.norm() < 2e-3
        generated = triton_model.generate(input_ids[:, :9], max_new_tokens=12, do_sample=False)
        reference = torch_model.generate(input_ids[:, :9], max_new_tokens=12, do_sample=False)
    assert (generated == reference).float().mean() > 0.9


# At these shapes (K = V = 64) the scans run on 16-wide bf16 tiles, which Triton 3.6 miscompiles unpipelined (an
# illegal address); chunk_fwd.scan_tile pipelines them.
def test_triton_training_step_gradients_match_torch_backend_bf16():
    # dense MLPs: top-k routing is discontinuous, and bf16 noise that flips one token's expert changes that expert's
    # gradient wholesale, whatever the kernels
    triton_model, torch_model = pair(mlp_layer_types=["dense"] * 5)
    input_ids = torch.randint(1, triton_model.config.vocab_size, (2, 130), device="cuda")
    grads = []
    for model in (triton_model, torch_model):
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    # bf16 autocast: both runs round the same matmuls; 5e-2 relative bounds the kernels' different summation order
    errors = {name: ((grads[0][name] - b).norm() / (b.norm() + 1e-12)).item() for name, b in grads[1].items()}
    assert set(grads[0]) == set(grads[1])
    assert max(errors.values()) <= 5e-2, sorted(errors.items(), key=lambda item: -item[1])[:8]
