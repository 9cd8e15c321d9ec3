"""Quantization of ``nn.Linear`` layers, chosen by config type (torchao's ``quantize_`` style).

``quantize_(model, Int8DynamicConfig(), filter_fn=...)`` swaps every selected linear for its
quantized form through a handler registered for the config's type:

- ``Int8DynamicConfig``: int8 weights, one scale per output channel; activations quantized per
  token at run time; int8 x int8 -> int32 matmuls (VNNI / AMX kernels where the CPU has them).
  Backend ``"torch_ao"`` uses ``torch.ao.nn.quantized.dynamic.Linear`` (fbgemm), the fastest here
  but part of the deprecated ``torch.ao.quantization`` API; backend ``"int_mm"`` is our own module
  over ``torch._int_mm``. ``"auto"`` takes ``torch_ao`` while it is importable and falls back to
  ``int_mm`` when a PyTorch release removes it, so user code does not change.
- ``Int8WeightOnlyConfig``: int8 weights dequantized at each call; halves weight memory versus
  bf16, does not speed matmuls up.
- ``Bf16WeightsConfig``: keep the weight in bfloat16 and upcast it to the activation dtype at each
  call. A MinerU2.5 checkpoint is stored in bfloat16, so float32 math on upcast weights is
  bit-identical to a float32 copy, at half the memory.
- ``FloatConfig``: cast the layer to a float dtype (e.g. keep the LM head in float32).

Quantized layers take and return the activation dtype of the model around them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .memory import trim_heap

__all__ = [
    "Int8DynamicConfig",
    "Int8WeightOnlyConfig",
    "Bf16WeightsConfig",
    "FloatConfig",
    "Int8DynamicLinear",
    "Int8WeightOnlyLinear",
    "Bf16WeightsLinear",
    "quantize_",
    "torch_ao_available",
]


@dataclass(frozen=True)
class Int8DynamicConfig:
    """Dynamic INT8: per-output-channel int8 weights, per-token int8 activations at run time."""

    backend: Literal["auto", "torch_ao", "int_mm"] = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "torch_ao", "int_mm"):
            raise ValueError(f"backend must be auto, torch_ao or int_mm, got {self.backend!r}")


@dataclass(frozen=True)
class Int8WeightOnlyConfig:
    """Weight-only INT8: int8 weights with per-output-channel scales, float activations."""


@dataclass(frozen=True)
class Bf16WeightsConfig:
    """bfloat16 weight storage, computation in the activation dtype."""


@dataclass(frozen=True)
class FloatConfig:
    """Keep the layer in floating point, cast to ``dtype``."""

    dtype: torch.dtype = torch.float32


def _per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization: ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8DynamicLinear(nn.Module):
    """``y = x W^T + b`` with int8 ``W`` (per output channel) and ``x`` quantized per token.

    Input ``[..., in_features]`` of any float dtype; output in the input's dtype.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = _per_channel_int8(linear.weight)
        self.register_buffer("weight_t", q.t().contiguous())  # [in, out] for _int_mm
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).float()
        x_scale = (x2.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        x_q = torch.round(x2 / x_scale).clamp(-127, 127).to(torch.int8)
        y = torch._int_mm(x_q, self.weight_t).float() * (x_scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


class Int8WeightOnlyLinear(nn.Module):
    """``y = x (q * scale)^T + b`` with the int8 weight dequantized to ``x``'s dtype per call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = _per_channel_int8(linear.weight)
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_q.to(x.dtype) * self.weight_scale.to(x.dtype)[:, None]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)


class Bf16WeightsLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in bfloat16 and cast to ``x``'s dtype per call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_bf16.to(x.dtype), bias)


class _TorchAoDynamicLinear(nn.Module):
    """``torch.ao`` dynamic quantized linear (fbgemm), with float32 conversion around it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        float_linear = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        float_linear.weight = nn.Parameter(linear.weight.detach().float())
        if linear.bias is not None:
            float_linear.bias = nn.Parameter(linear.bias.detach().float())
        float_linear.qconfig = per_channel_dynamic_qconfig  # int8 weights, one scale per output channel
        with warnings.catch_warnings():  # the deprecation is known and handled: see the module docstring
            warnings.filterwarnings(
                "ignore", message=".*quantize_per_(tensor|channel).*deprecated", category=UserWarning
            )
            self.inner = DynamicLinear.from_float(float_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float()).to(x.dtype)


def torch_ao_available() -> bool:
    """Whether ``torch.ao``'s dynamic quantized linear (fbgemm or onednn engine) can be used."""
    try:
        from torch.ao.nn.quantized.dynamic import Linear  # noqa: F401
    except ImportError:
        return False
    return any(engine in torch.backends.quantized.supported_engines for engine in ("fbgemm", "onednn", "x86"))


def _int8_dynamic(linear: nn.Linear, config: Int8DynamicConfig) -> nn.Module:
    backend = config.backend
    if backend == "auto":
        backend = "torch_ao" if torch_ao_available() else "int_mm"
    return _TorchAoDynamicLinear(linear) if backend == "torch_ao" else Int8DynamicLinear(linear)


_HANDLERS: dict[type, Callable[[nn.Linear, object], nn.Module]] = {
    Int8DynamicConfig: _int8_dynamic,  # type: ignore[dict-item]
    Int8WeightOnlyConfig: lambda linear, _: Int8WeightOnlyLinear(linear),
    Bf16WeightsConfig: lambda linear, _: Bf16WeightsLinear(linear),
    FloatConfig: lambda linear, config: linear.to(config.dtype),  # type: ignore[attr-defined]
}


def quantize_(model: nn.Module, config: object, filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Replace the ``nn.Linear`` layers of ``model`` selected by ``filter_fn(module, name)`` in place.

    Args:
        model: any module; its linears are found by ``named_modules``.
        config: an instance of a registered config type (``Int8DynamicConfig``, ...).
        filter_fn: selects layers by module and dotted name; default all linears.

    Returns:
        ``model``, modified in place.

    Raises:
        TypeError: no handler is registered for ``type(config)``.
    """
    handler = _HANDLERS.get(type(config))
    if handler is None:
        raise TypeError(
            f"no quantization handler for {type(config).__name__}; known: {[t.__name__ for t in _HANDLERS]}"
        )
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (filter_fn is None or filter_fn(module, name))
    ]
    for name in names:  # one layer at a time: each float weight is freed as soon as it is replaced
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, handler(getattr(parent, child), config))
        trim_heap()  # and its memory handed back, so peak RSS stays near the live weights
    return model
