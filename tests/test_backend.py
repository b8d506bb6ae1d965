"""The backend switch: env override, per-call 'auto', explicit 'triton' never falls back silently."""

import pytest
import torch

from kda_moe.kernels import BACKENDS, gated_rms_norm, kimi_delta_attention, resolve_backend, short_conv, short_conv_step
from kda_moe.kernels import backend


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("KDA_MOE_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backend, "_TRITON_OPS", {})  # registrations made by a test vanish after it
    monkeypatch.setattr(backend, "_AUTO_TRITON_OPS", set())


def test_backends_are_the_three_documented_names():
    assert BACKENDS == ("auto", "triton", "torch")


def test_auto_on_cpu_gives_torch_even_with_a_registered_kernel():
    x = torch.randn(2)
    assert resolve_backend("auto", x, op="kda") == "torch"
    backend.register_triton_op("kda", lambda *a, **kw: None)
    assert resolve_backend("auto", x, op="kda") == "torch"
    assert resolve_backend("torch", x, op="kda") == "torch"


def test_env_var_overrides_the_requested_backend(monkeypatch):
    monkeypatch.setenv("KDA_MOE_BACKEND", "torch")
    assert resolve_backend("triton", torch.randn(2), op="kda") == "torch"
    monkeypatch.setenv("KDA_MOE_BACKEND", "triton")
    with pytest.raises(NotImplementedError, match="Triton kernels are not built yet"):
        resolve_backend("torch", torch.randn(2), op="kda")


def test_unknown_backend_names_raise_listing_the_allowed_values(monkeypatch):
    allowed = r"allowed values are \('auto', 'triton', 'torch'\)"
    with pytest.raises(ValueError, match=r"Unknown kernel backend 'cuda' \(from kernel_backend\).*" + allowed):
        resolve_backend("cuda", torch.randn(2), op="kda")
    monkeypatch.setenv("KDA_MOE_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"Unknown kernel backend 'fast' \(from the env var KDA_MOE_BACKEND\)"):
        resolve_backend("auto", torch.randn(2), op="kda")


def test_explicit_triton_without_kernels_raises_and_names_the_fix():
    with pytest.raises(NotImplementedError, match=r'not built yet.*kernel_backend="torch"'):
        resolve_backend("triton", torch.randn(2), op="short_conv")


def test_explicit_triton_on_cpu_raises_unless_interpreted(monkeypatch):
    backend.register_triton_op("gated_rms_norm", lambda *a: "triton result")
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="needs CUDA tensors but got tensors on cpu.*TRITON_INTERPRET=1"):
        resolve_backend("triton", x, op="gated_rms_norm")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", x, op="gated_rms_norm") == "triton"
    assert gated_rms_norm(x, x, torch.ones(8), backend="triton") == "triton result"


def test_registration_works_as_a_decorator():
    @backend.register_triton_op("short_conv")
    def fake(x, weight, **kwargs):
        return x

    assert backend.triton_op_available("short_conv") and backend.triton_op("short_conv") is fake
    assert not backend.triton_op_available("kda")


def test_every_public_op_refuses_triton_until_its_kernel_exists():
    H, K = 2, 4
    q = torch.randn(1, 3, H, K)
    with pytest.raises(NotImplementedError, match="op 'kda'"):
        kimi_delta_attention(q, q, q, q, torch.randn(1, 3, H), torch.zeros(H), torch.zeros(H * K), backend="triton")
    with pytest.raises(NotImplementedError, match="op 'short_conv'"):
        short_conv(torch.randn(1, 3, 5), torch.randn(5, 4), backend="triton")
    with pytest.raises(NotImplementedError, match="op 'short_conv_step'"):
        short_conv_step(torch.randn(1, 5), torch.randn(5, 4), torch.zeros(1, 5, 3), backend="triton")
    with pytest.raises(NotImplementedError, match="op 'gated_rms_norm'"):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_picks_triton_only_for_registered_ops():
    x = torch.randn(2, device="cuda")
    assert resolve_backend("auto", x, op="kda") == "torch"
    backend.register_triton_op("kda", lambda *a, **kw: None)
    assert resolve_backend("auto", x, op="kda") == "triton"
    assert resolve_backend("auto", x, op="kda", supported=False) == "torch"  # inputs the kernel does not take
    assert resolve_backend("triton", x, op="kda", supported=False) == "triton"  # explicit: the kernel raises
    assert resolve_backend("auto", x, torch.randn(2), op="kda") == "torch"  # mixed devices stay on torch
    backend.register_triton_op("kda", lambda *a, **kw: None, auto=False)  # explicit-only kernel
    assert resolve_backend("auto", x, op="kda") == "torch"
    assert resolve_backend("triton", x, op="kda") == "triton"
