"""Benchmark scripts in their CPU tests: loaded by path (``benchmarks/`` is no package), and the single-kernel
benchmarks (``moe_decode.py``, ``mla_decode.py``, ``decode_projections.py``) on stand-in timings, so that their
plumbing (rows, sweeps, tables) runs under the Triton interpreter. The numbers are not checked."""

import importlib.util
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str):
    """``benchmarks/<script>`` as a module."""
    path = BENCHMARKS / script
    spec = importlib.util.spec_from_file_location(f"{path.stem}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in_timings(module, monkeypatch) -> None:
    """A single-kernel benchmark on CPU in fp32 (the interpreter's bf16 tl.dot is wrong): every timed call runs once
    and takes 1 ms, the copy bandwidth is 1 GB/s and nothing is captured in a CUDA graph."""
    timing = module.kernel_timing
    monkeypatch.setattr(timing, "bench", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(timing, "graphed", lambda fn: fn)
    monkeypatch.setattr(timing, "copy_GBps", lambda: 1.0)
    monkeypatch.setattr(module, "dev", "cpu")
    monkeypatch.setattr(module, "DTYPE", torch.float32)
