"""Inference engines: requests (image + prompt + decoding rules) in, token sequences out.

This package is the only part of mineru-fast that touches torch.
"""

from mineru_fast.engine.base import GenerationRequest, GenerationResult
from mineru_fast.engine.interface import Engine

__all__ = ["Engine", "GenerationRequest", "GenerationResult"]
