"""Inference engines: requests (image + prompt + decoding rules) in, token sequences out.

This package is the only part of mineru-fast that touches torch.
"""

from .base import Engine, GenerationRequest, GenerationResult

__all__ = ["Engine", "GenerationRequest", "GenerationResult"]
