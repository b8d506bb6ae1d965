"""What the Triton KDA kernels take, without importing Triton, so that the public ops and the configuration can ask
before a kernel is chosen: the chunk length, the head dims and the gate bound within which every tile is a GEMM."""

CHUNK_SIZE = 64  # tokens per chunk of the chunked kernels (four 16-row tensor-core tiles) and the reference's default
# |gate_lower_bound| up to which a bounded gate keeps every 16-token tile's decay within what one fp32 reference can
# factor (e^-94.4 across a tile), so the kernels' diagonal tiles are dense GEMMs
SAFE_LOWER_BOUND = 5.9


def fits_triton_tiles(K: int, V: int) -> bool:
    """Whether the kernels take head dims K and V: powers of two >= 16 (``tl.arange`` and the tensor-core tiles)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (K, V))


def require_triton_tiles(K: int, V: int):
    if not fits_triton_tiles(K, V):
        raise ValueError(
            f"the Triton KDA kernels need K and V powers of two >= 16, got K={K}, V={V}; "
            'use kernel_backend="torch" (or "auto", which runs such head dims on the PyTorch reference).'
        )
