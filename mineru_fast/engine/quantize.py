"""Quantization of ``nn.Linear`` layers, chosen by config type (torchao's ``quantize_`` style).

``quantize_(model, Int8DynamicConfig(), filter_fn=...)`` swaps every selected linear for its
quantized form through a handler registered for the config's type:

- ``Int8DynamicConfig``: dynamic INT8, int8 x int8 products accumulated in int32. What each
  ``backend`` does exactly:

  ============  ==========================  ===================================  =====================
  backend       weights                     activations (quantized every call)   kernel
  ============  ==========================  ===================================  =====================
  ``onednn``    int8, symmetric, one scale  int8, symmetric, one scale per       oneDNN u8 x s8 -> s32
                per output channel          token (row): ``max|x_row| / 127``    (VNNI / AMX where
                                            rounded half up; passed as uint8     present), weight scale
                                            ``q + 128`` with zero point 128      fused, float32 out
  ``int_mm``    as ``onednn``               as ``onednn``, as signed int8,       ``torch._int_mm``
                                            rounded half to even                 s8 x s8 -> s32
  ``torch_ao``  int8, symmetric, one scale  uint8, asymmetric, ONE scale and     fbgemm u8 x s8 -> s32
                per output channel          zero point for the whole tensor,     (``x86`` engine),
                (range -128..127)           7 bits (0..127, ``reduce_range``)    bias fused
  ============  ==========================  ===================================  =====================

  On CPUs without VNNI (AVX2, AVX-512 without VNNI) int8 GEMMs multiply u8 x s8 pairs into
  saturating 16-bit sums (``vpmaddubsw``): 2 * 255 * 127 overflows. ``torch_ao`` avoids it with
  7-bit activations; ``onednn`` and ``int_mm`` use 7-bit weights (``max|w| / 63``, and
  2 * 255 * 63 fits) when a probe of the kernel at first use finds its 8-bit products inexact.
  So the integer products are exact on every ISA (tested under simulated classes), and the
  activation granularity is what differs: per token for ``onednn`` / ``int_mm``, per tensor for
  ``torch_ao`` (whose one scale follows the largest value anywhere in the batch).
  ``"auto"`` is the per-token ``onednn`` kernel, ``int_mm`` where PyTorch lacks oneDNN's
  quantized linear ops, ``torch_ao`` where both are missing. Which one is fastest on a CPU class
  is measured, not assumed (``mineru_fast.choice``). ``torch_ao`` is the deprecated
  ``torch.ao.quantization`` API.
- ``Int8WeightOnlyConfig``: int8 weights dequantized at each call; halves weight memory versus
  bf16, does not speed matmuls up.
- ``Bf16WeightsConfig``: keep the weight in bfloat16 and upcast it to the activation dtype at each
  call. A MinerU2.5 checkpoint is stored in bfloat16, so float32 math on upcast weights is
  bit-identical to a float32 copy, at half the memory.
- ``FloatConfig``: cast the layer to a float dtype (e.g. keep the LM head in float32).

Quantized layers take and return the activation dtype of the model around them.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .memory import trim_heap

__all__ = [
    "INT8_BACKENDS",
    "Int8DynamicConfig",
    "Int8WeightOnlyConfig",
    "Bf16WeightsConfig",
    "FloatConfig",
    "OneDnnInt8Linear",
    "IntMmInt8Linear",
    "Int8WeightOnlyLinear",
    "Bf16WeightsLinear",
    "quantize_",
    "resolve_int8_backend",
    "int8_kernel_path",
    "int8_weight_max",
    "torch_ao_available",
]

INT8_BACKENDS = ("auto", "onednn", "int_mm", "torch_ao")


@dataclass(frozen=True)
class Int8DynamicConfig:
    """Dynamic INT8 linears; ``backend`` picks the kernel (see the module docstring's table)."""

    backend: Literal["auto", "onednn", "int_mm", "torch_ao"] = "auto"

    def __post_init__(self) -> None:
        if self.backend not in INT8_BACKENDS:
            raise ValueError(f"backend must be one of {INT8_BACKENDS}, got {self.backend!r}")


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


def _per_channel_int8(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization to ``-qmax..qmax``: ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / qmax).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-qmax, qmax).to(torch.int8), scale


def _onednn_matmul(qx: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``(qx - 128) @ W_q^T * weight_scale`` in float32: ``qx`` ``[M, K]`` uint8, ``packed`` from
    ``onednn.qlinear_prepack``, ``weight_scale`` ``[N]`` float32."""
    zero_points = torch.zeros(weight_scale.shape[0], dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(
        qx, 1.0, 128, packed, weight_scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def _int_mm_matmul(qx: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(qx, weight_t)


@functools.cache
def int8_weight_max(backend: str) -> int:
    """Largest int8 weight magnitude the ``onednn`` or ``int_mm`` kernel multiplies exactly: 127,
    or 63 where a probe finds its 8-bit products saturate (int8 GEMMs without VNNI).

    The probe multiplies the worst case (every activation 127, weights +-127 over 64 products,
    at 1 and 32 rows) and compares with the exact integer result, so it follows the kernel the
    process really runs, including an ISA capped by ``ONEDNN_MAX_CPU_ISA``.
    """
    k, n = 64, 16
    weight = torch.full((n, k), 127, dtype=torch.int8)
    weight[1::2] = -127
    for m in (1, 32):
        x = torch.full((m, k), 127, dtype=torch.int8)
        exact = x.double() @ weight.double().t()
        if backend == "onednn":
            packed = torch.ops.onednn.qlinear_prepack(weight, None)
            got = _onednn_matmul((x.int() + 128).to(torch.uint8), packed, torch.ones(n))
        else:
            got = _int_mm_matmul(x, weight.t().contiguous())
        if not torch.equal(got.double(), exact):
            return 63
    return 127


_scratch = threading.local()


def _scratch_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A reused per-thread work buffer of ``shape`` (contents undefined). Temporaries of the size of
    a layer's input are otherwise fresh allocations that the OS maps in page by page at every call;
    on a 2-core VM that cost more than the int8 GEMM itself (5476 x 5120 float32: ~0.45 s of page
    faults, against 2.6 ms to read it)."""
    size = 1
    for dim in shape:
        size *= dim
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.numel() < size:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buffer = torch.empty(size, dtype=dtype)
        setattr(_scratch, name, buffer)
    return buffer[:size].view(shape)


class _PerTokenInt8Linear(nn.Module):
    """Shared by the per-token kernels: int8 weights, one float32 scale per output channel."""

    backend = ""
    weight_scale: torch.Tensor  # buffers: [out] float32, [out] float32 or None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_max = int8_weight_max(self.backend)
        q, scale = _per_channel_int8(linear.weight, self.weight_max)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._pack(q)

    def _pack(self, q: torch.Tensor) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=+-{self.weight_max}"

    @staticmethod
    def _token_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row ``(scale, 127 / max|x_row|)``, both ``[M, 1]`` float32 (all-zero rows: scale 1e-12).
        ``max(amax, -amin)``: two vectorized reductions, no temporary (``abs().amax()`` and
        ``vector_norm(inf)`` write an ``|x|`` copy first)."""
        absmax = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg_()).clamp_(min=127e-12)
        return absmax / 127.0, absmax.reciprocal_().mul_(127.0)

    def _finish(self, y: torch.Tensor, x_scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is None:
            y.mul_(x_scale)
        else:
            torch.addcmul(self.bias, y, x_scale, out=y)
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


_HALF_OFFSET = torch.tensor(128.5)


class OneDnnInt8Linear(_PerTokenInt8Linear):
    """``y = x W^T + b``, backend ``onednn``: per-token int8 activations, per-channel int8
    weights, oneDNN's u8 x s8 -> s32 GEMM (see the module docstring).

    Input ``[..., in_features]`` of any float dtype; output in the input's dtype.
    """

    backend = "onednn"

    def _pack(self, q: torch.Tensor) -> None:
        self.weight_packed = torch.ops.onednn.qlinear_prepack(q, None)  # oneDNN blocked layout: no buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).float()
        x_scale, inv = self._token_scales(x2)
        # round(x / scale) + 128 as uint8: x * inv lies in [-127, 127], so + 128.5 is positive
        # and the float -> uint8 conversion's truncation rounds half up, in two passes.
        shifted = torch.addcmul(_HALF_OFFSET, x2, inv, out=_scratch_tensor("f32", x2.shape, torch.float32))
        qx = _scratch_tensor("u8", x2.shape, torch.uint8).copy_(shifted)
        y = _onednn_matmul(qx, self.weight_packed, self.weight_scale)
        return self._finish(y, x_scale, shape, dtype)


class IntMmInt8Linear(_PerTokenInt8Linear):
    """``y = x W^T + b``, backend ``int_mm``: per-token int8 activations, per-channel int8 weights,
    ``torch._int_mm`` s8 x s8 -> s32 (see the module docstring).

    Input ``[..., in_features]`` of any float dtype; output in the input's dtype.
    """

    backend = "int_mm"
    weight_t: torch.Tensor  # buffer [in, out] int8

    def _pack(self, q: torch.Tensor) -> None:
        self.register_buffer("weight_t", q.t().contiguous())  # [in, out] for _int_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).float()
        x_scale, inv = self._token_scales(x2)
        scaled = torch.mul(x2, inv, out=_scratch_tensor("f32", x2.shape, torch.float32)).round_()
        qx = _scratch_tensor("i8", x2.shape, torch.int8).copy_(scaled)
        y = torch.mul(_int_mm_matmul(qx, self.weight_t), self.weight_scale)
        return self._finish(y, x_scale, shape, dtype)


class Int8WeightOnlyLinear(nn.Module):
    """``y = x (q * scale)^T + b`` with the int8 weight dequantized to ``x``'s dtype per call."""

    weight_q: torch.Tensor  # buffers: [out, in] int8, [out] float32, [out] float32 or None
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

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

    weight_bf16: torch.Tensor  # buffers: [out, in] bfloat16, [out] float32 or None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_bf16.to(x.dtype), bias)


class _TorchAoDynamicLinear(nn.Module):
    """Backend ``torch_ao``: ``torch.ao`` dynamic quantized linear (fbgemm under the ``x86``
    engine; per-tensor 7-bit activations, see the module docstring), float32 around it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        float_linear = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        float_linear.weight = nn.Parameter(linear.weight.detach().float())
        if linear.bias is not None:
            float_linear.bias = nn.Parameter(linear.bias.detach().float())
        # int8 weights, one scale per output channel; Module.__setattr__ is typed for tensors and modules only
        float_linear.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
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


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.onednn, op) for op in ("qlinear_prepack", "qlinear_pointwise")
    )


def resolve_int8_backend(backend: str = "auto") -> str:
    """The kernel ``Int8DynamicConfig(backend)`` gets in this PyTorch: ``"auto"`` -> ``"onednn"``,
    else ``"int_mm"`` without oneDNN's quantized linear ops, else ``"torch_ao"``; others as given.

    Raises:
        ValueError: unknown backend.
    """
    if backend not in INT8_BACKENDS:
        raise ValueError(f"backend must be one of {INT8_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if _onednn_available():
        return "onednn"
    return "int_mm" if hasattr(torch, "_int_mm") else "torch_ao"


def int8_kernel_path(backend: str) -> str:
    """One line saying what ``backend``'s kernel does here (weights, activations, kernel), with the
    weight range the probe found (``int8_weight_max``) for the per-token kernels.

    Raises:
        ValueError: unknown backend.
    """
    backend = resolve_int8_backend(backend)
    if backend == "torch_ao":
        engine = torch.backends.quantized.engine
        return (
            f"torch_ao: int8 weights per channel; uint8 activations per tensor, 7-bit (reduce_range); {engine} engine"
        )
    kernel = "oneDNN u8s8s32" if backend == "onednn" else "torch._int_mm s8s8s32"
    bits = 8 if int8_weight_max(backend) == 127 else 7
    return f"{backend}: int8 weights per channel ({bits}-bit); int8 activations per token; {kernel}"


def _int8_dynamic(linear: nn.Linear, config: Int8DynamicConfig) -> nn.Module:
    backend = resolve_int8_backend(config.backend)
    if backend == "torch_ao":
        return _TorchAoDynamicLinear(linear)
    return OneDnnInt8Linear(linear) if backend == "onednn" else IntMmInt8Linear(linear)


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
