"""Programmatic dependent launch of the decoding kernels (`kernels/dependent_launch.py`): where it is on, and that a
chain of dependent kernels, each reading what the one before it wrote, computes what the same chain computes in plain
stream order, bit for bit, eagerly and replayed as a CUDA graph (a kernel reading its input before the wait would
race its predecessor and differ)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kda_moe.kernels import dependent_launch as launch_module  # noqa: E402
from kda_moe.kernels.linear import decode_projections  # noqa: E402
from kda_moe.kernels.moe import moe_decode, router_logits, top_k_routing  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_dependent_only_where_supported_and_not_when_switched_off(monkeypatch):
    monkeypatch.delenv(launch_module.ENV_VAR, raising=False)
    assert launch_module.dependent_launch(torch.device("cpu")) == {"DEPENDENT": False}  # the interpreter
    monkeypatch.setattr(launch_module, "_supported", lambda device: True)
    assert launch_module.dependent_launch(torch.device("cpu")) == {"DEPENDENT": True, "launch_pdl": True}
    monkeypatch.setenv(launch_module.ENV_VAR, "0")
    assert launch_module.dependent_launch(torch.device("cpu")) == {"DEPENDENT": False}


def decode_chain(x, weights, router, bias, gate_up, down):
    """A decoding step's kernel sequence, each kernel's input the output of the one just before it: projections,
    router logits, top-k, the MoE decode's three kernels, projections again."""
    for w in weights:
        x = decode_projections(x, [w], backend="triton")[0]
    top_k_weights, top_k_index = top_k_routing(router_logits(x, router, backend="triton"), bias, 4, n_group=1,
                                               topk_group=1, renormalize=True, scale=1.0, backend="triton")
    x = moe_decode(x, top_k_index, top_k_weights, gate_up, down, activation="situ", gate_cap=4.0, up_cap=25.0,
                   backend="triton")
    return decode_projections(x, weights[:2], backend="triton")


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a CUDA GPU of compute capability 9.0+")
def test_a_dependent_chain_gives_the_stream_ordered_chain_bit_for_bit(monkeypatch):
    g = torch.Generator("cuda").manual_seed(0)
    d, E, inter = 1024, 16, 512
    weights = [torch.randn(d, d, device="cuda", generator=g).div(d ** 0.5).bfloat16() for _ in range(12)]
    router, bias = torch.randn(E, d, device="cuda", generator=g), torch.zeros(E, device="cuda")
    gate_up = torch.randn(E, 2 * inter, d, device="cuda", generator=g).div(d ** 0.5).bfloat16()
    down = torch.randn(E, d, inter, device="cuda", generator=g).div(inter ** 0.5).bfloat16()
    x = torch.randn(1, d, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        monkeypatch.setenv(launch_module.ENV_VAR, "0")
        expected = decode_chain(x, weights, router, bias, gate_up, down)
        monkeypatch.setenv(launch_module.ENV_VAR, "1")
        assert launch_module.dependent_launch(x.device)["DEPENDENT"]
        eager = decode_chain(x, weights, router, bias, gate_up, down)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = decode_chain(x, weights, router, bias, gate_up, down)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(replayed, expected))
    assert all(torch.equal(a, b) for a, b in zip(eager, expected))
