"""Losses computed from a head's input and weight, so that the head's output is never built whole."""

from .cross_entropy import LOGITS_CHUNK_ELEMENTS, linear_cross_entropy

__all__ = ["LOGITS_CHUNK_ELEMENTS", "linear_cross_entropy"]
