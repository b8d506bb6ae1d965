"""Which head dims the Triton KDA kernels take: K and V are tiled by powers of two >= 16 (``tl.arange`` and the
tensor-core tiles). No Triton import, so the public ops can ask before a kernel is chosen."""


def fits_triton_tiles(K: int, V: int) -> bool:
    return all(d >= 16 and d & (d - 1) == 0 for d in (K, V))


def require_triton_tiles(K: int, V: int):
    if not fits_triton_tiles(K, V):
        raise ValueError(
            f"the Triton KDA kernels need K and V powers of two >= 16, got K={K}, V={V}; "
            'use kernel_backend="torch" (or "auto", which runs such head dims on the PyTorch reference).'
        )
