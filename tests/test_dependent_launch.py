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


def test_dependent_only_inside_the_context_where_supported_and_not_when_switched_off(monkeypatch):
    monkeypatch.delenv(launch_module.ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    with launch_module.dependent_launches():
        assert launch_module.dependent_launch(cpu) == {"DEPENDENT": False}  # the interpreter
    monkeypatch.setattr(launch_module, "_hardware_supports", lambda device: True)
    assert launch_module.dependent_launch(cpu) == {"DEPENDENT": False}  # outside: stream order
    with launch_module.dependent_launches():
        assert launch_module.dependent_launch(cpu) == {"DEPENDENT": True, "launch_pdl": True}
        with launch_module.dependent_launches(False):
            assert launch_module.dependent_launch(cpu) == {"DEPENDENT": False}
        assert launch_module.dependent_launch(cpu)["DEPENDENT"]
        monkeypatch.setenv(launch_module.ENV_VAR, "0")
        assert launch_module.dependent_launch(cpu) == {"DEPENDENT": False}
    assert not launch_module.dependent_launch_supported(cpu)


def test_graphed_decoding_compiles_inductor_kernels_dependent_where_ours_are(monkeypatch):
    """The graphed path's compile options: inductor's `triton.enable_pdl`, and the compiled call run inside
    `dependent_launches()`, where supported, unless the config names a mode of its own; never inductor's own CUDA
    graphs."""
    from conftest import tiny_model
    from transformers.generation import CompileConfig

    from kda_moe.modeling import graphed_decoding

    seen = []  # torch.compile's options; the stand-in compiled call returns the launch arguments our kernels get
    monkeypatch.setattr(torch, "compile", lambda fn, **options: seen.append(options)
                        or (lambda: launch_module.dependent_launch(torch.device("cpu"))))
    monkeypatch.setattr(launch_module, "_hardware_supports", lambda device: True)
    monkeypatch.setattr(graphed_decoding, "dependent_launch_supported", lambda device: True)
    model = tiny_model(seed=0)
    forward = graphed_decoding.uncaptured_compile_call(model, CompileConfig(fullgraph=True))
    assert seen[-1]["mode"] is None
    assert seen[-1]["options"] == {"triton.enable_pdl": True, "triton.cudagraphs": False}
    assert forward() == {"DEPENDENT": True, "launch_pdl": True}
    forward = graphed_decoding.uncaptured_compile_call(model, CompileConfig(fullgraph=True, mode="max-autotune"))
    assert seen[-1]["mode"] == "max-autotune" and not seen[-1]["options"]
    assert forward() == {"DEPENDENT": False}
    monkeypatch.setattr(graphed_decoding, "dependent_launch_supported", lambda device: False)
    forward = graphed_decoding.uncaptured_compile_call(model, CompileConfig(fullgraph=True))
    assert seen[-1]["mode"] == "default" and not seen[-1]["options"]
    assert forward() == {"DEPENDENT": False}


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
    monkeypatch.delenv(launch_module.ENV_VAR, raising=False)
    with torch.no_grad():
        expected = decode_chain(x, weights, router, bias, gate_up, down)
        with launch_module.dependent_launches():
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
