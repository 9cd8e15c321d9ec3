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
  ``gemv``      as ``onednn``, in plain     as ``onednn``                        1-16 rows: the own
                ``[out, in]`` layout                                             AVX-512 VNNI GEMV
                                                                                 (``engine.kernels``),
                                                                                 more: ``torch._int_mm``
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
  On the avx2 class, where oneDNN's AVX2 GEMM runs 7-bit weights, the ``onednn`` layers run an own
  AVX2 GEMM instead (``kernels.per_channel_gemm_status``; ``OneDnnInt8Linear``): the same
  instructions, the same outputs bit for bit, the row scales and the bias applied as it writes them.
  The ``onednn`` and ``gemv`` activations are quantized in one pass by the own kernel where it
  runs (``kernels.KernelStatus.quantize_tokens``: the bits of PyTorch's operators on its AVX2 and
  AVX-512 builds; a vision block's four linears 0.77x the time on an AMX Xeon,
  ``benchmarks/token_quantize.py``), by those operators elsewhere.
  ``gemv`` gives ``onednn``'s outputs bit for bit (the same integers, the same float steps): the
  fast engine runs its language model on it where the own kernel builds (``engine.factory``), since
  decode steps of a few rows are bound by reading the weights, which it does faster than oneDNN
  there (``benchmarks/decode_step.py``), while vision's GEMMs of thousands of rows stay on ``onednn``.
  ``"auto"`` is the per-token ``onednn`` kernel, ``int_mm`` where PyTorch lacks oneDNN's
  quantized linear ops, ``torch_ao`` where both are missing. Which one is fastest on a CPU class
  is measured, not assumed (``mineru_fast.runtime.choice``). ``torch_ao`` is the deprecated
  ``torch.ao.quantization`` API.
- ``Int8BlockConfig``: dynamic INT8 with one scale per block of ``BLOCK`` (32) consecutive input
  values, for weights (per output channel and block) and activations (per token and block): the
  granularity of llama.cpp's Q8_0, which MinerU 4 runs on CPUs; the fast preset's language model
  and head. Finer scales than per channel / per token keep the language model closer to float32
  (on a trained Qwen2 of MinerU2.5's shape: 98.6 % top-1 agreement with fp32 over all forced
  steps against per-channel's 94.3 % and bf16's 98.5 %, benchmarks/README.md); the cost is a
  float multiply-add per block and output, done by the own kernel (``csrc/kernels.h``,
  ``BlockInt8Linear``) for decode rows and prefill chunks alike. Each row is computed alone, so a
  sequence's numerics do not depend on its batch neighbours.
- ``Int8WeightOnlyConfig``: int8 weights dequantized at each call; halves weight memory versus
  bf16, does not speed matmuls up.
- ``Bf16WeightsConfig``: keep the weight in bfloat16 and upcast it to the activation dtype at each
  call. A MinerU2.5 checkpoint is stored in bfloat16, so float32 math on upcast weights is
  bit-identical to a float32 copy, at half the memory.

Quantized layers take and return the activation dtype of the model around them.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mineru_fast.engine.kernels import (
    GEMM_PANEL,
    GEMM_WEIGHT_MAX,
    MAX_ROWS,
    ONEDNN_GEMM,
    BoundBlockLinear,
    bind_block_linear,
    check_block_weight,
    check_gemv_weight,
    kernel_status,
    per_channel_gemm_status,
)
from mineru_fast.engine.memory import trim_heap

__all__ = [
    "INT8_BACKENDS",
    "Int8DynamicConfig",
    "Int8WeightOnlyConfig",
    "Int8BlockConfig",
    "Bf16WeightsConfig",
    "BlockInt8Linear",
    "block_int8_reference",
    "fma_float32",
    "OneDnnInt8Linear",
    "IntMmInt8Linear",
    "GemvInt8Linear",
    "Int8WeightOnlyLinear",
    "Bf16WeightsLinear",
    "quantize_",
    "quantize_linear",
    "resolve_int8_backend",
    "int8_kernel_path",
    "int8_weight_max",
    "torch_ao_available",
]

INT8_BACKENDS = ("auto", "onednn", "gemv", "int_mm", "torch_ao")


@dataclass(frozen=True)
class Int8DynamicConfig:
    """Dynamic INT8 linears; ``backend`` picks the kernel (see the module docstring's table)."""

    backend: Literal["auto", "onednn", "gemv", "int_mm", "torch_ao"] = "auto"

    def __post_init__(self) -> None:
        if self.backend not in INT8_BACKENDS:
            raise ValueError(f"backend must be one of {INT8_BACKENDS}, got {self.backend!r}")


@dataclass(frozen=True)
class Int8WeightOnlyConfig:
    """Weight-only INT8: int8 weights with per-output-channel scales, float activations."""


@dataclass(frozen=True)
class Int8BlockConfig:
    """Block-wise dynamic INT8: one scale per ``BLOCK`` input values of each weight row and of each
    activation row (``BlockInt8Linear``)."""


@dataclass(frozen=True)
class Bf16WeightsConfig:
    """bfloat16 weight storage, computation in the activation dtype."""


# Output channels quantized per pass: each row's scale and rounding are its own, so chunking changes
# no value, and the float32 temporaries stay at a few MB (whole, the 151,936-row LM head needed
# ~1.6 GB of them: three float32 copies of a 0.27 GB bfloat16 matrix).
QUANTIZE_CHUNK_ROWS = 4096


def _per_channel_int8(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization to ``-qmax..qmax``: ``weight ~= q * scale[:, None]``.

    ``weight`` ``[out, in]`` of any float dtype -> ``q`` ``[out, in]`` int8 and ``scale`` ``[out]``
    float32, computed ``QUANTIZE_CHUNK_ROWS`` rows at a time.
    """
    weight = weight.detach()
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], QUANTIZE_CHUNK_ROWS):
        rows = slice(start, start + QUANTIZE_CHUNK_ROWS)
        w = weight[rows].float()
        s = scale[rows]
        torch.clamp(w.abs().amax(dim=1) / qmax, min=1e-12, out=s)
        q[rows] = torch.round(w / s[:, None]).clamp_(-qmax, qmax)
    return q, scale


def _onednn_matmul(
    qx: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """``(qx - 128) @ W_q^T * weight_scale`` in float32: ``qx`` ``[M, K]`` uint8, ``packed`` from
    ``onednn.qlinear_prepack``, ``weight_scale`` ``[N]`` float32, ``zero_points`` ``[N]`` int64
    zeros (symmetric weights; passed in so a decode step does not build one per layer)."""
    return torch.ops.onednn.qlinear_pointwise(
        qx, 1.0, 128, packed, weight_scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def _int_mm_matmul(qx: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(qx, weight_t)


def _scaled(acc: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``acc * weight_scale`` in float32, in ``acc``'s storage (``[M, N]`` int32, contiguous):
    converted to float32 in place (each element is read and written at the same address, 4 bytes
    both ways), then scaled in place. ``torch.mul(acc, weight_scale)`` allocates a float32 copy of
    ``acc`` and then its result: two more ``[M, N]`` (a 512-row prefill chunk's ``w_gate_up``: 20 MB
    each). The same values (tested)."""
    out = acc.view(torch.float32)
    out.copy_(acc)
    return out.mul_(weight_scale)


@functools.cache
def _zero_points(rows: int) -> torch.Tensor:
    """``[rows]`` int64 zeros: the weight zero points of a symmetric oneDNN layer, one tensor per
    size shared by every layer (per layer they were ~3 MB over the vision tower), never written."""
    return torch.zeros(rows, dtype=torch.long)


@functools.cache
def int8_weight_max(backend: str) -> int:
    """Largest int8 weight magnitude the ``onednn`` or ``int_mm`` kernel multiplies exactly: 127,
    or 63 where a probe finds its 8-bit products saturate (int8 GEMMs without VNNI). ``gemv``
    (VNNI only, exact at 127) is used only where ``int_mm``, its GEMM of many rows, gives ``onednn``'s.

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
            got = _onednn_matmul(
                (x.int() + 128).to(torch.uint8), packed, torch.ones(n), torch.zeros(n, dtype=torch.long)
            )
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


_HALF_OFFSET = torch.tensor(128.5)


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

    def prepared_state(self) -> dict[str, torch.Tensor]:
        """The tensors that define this layer (``from_prepared`` rebuilds it from them): the int8
        weight (``weight_q`` ``[out, in]`` for ``onednn`` and ``gemv``, ``weight_t`` ``[in, out]``
        for ``int_mm``; ``gemv`` adds its rows' sums, ``weight_sum`` ``[out]`` int32),
        ``weight_scale`` ``[out]`` float32, ``weight_max`` ``[1]`` int8 and, when the layer has
        one, ``bias`` ``[out]`` float32."""
        state = {**self._weight_state(), "weight_scale": self.weight_scale}
        state["weight_max"] = torch.tensor([self.weight_max], dtype=torch.int8)
        if self.bias is not None:
            state["bias"] = self.bias
        return state

    @classmethod
    def from_prepared(cls, state: dict[str, torch.Tensor]) -> _PerTokenInt8Linear:
        """The layer ``prepared_state`` described (the same outputs, bit for bit).

        Raises:
            KeyError: a tensor is missing.
        """
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight_max = int(state["weight_max"][0])
        layer.register_buffer("weight_scale", state["weight_scale"])
        layer.register_buffer("bias", state.get("bias"))
        layer.out_features = state["weight_scale"].shape[0]
        layer.in_features = layer._load_weight(state)
        return layer

    def _weight_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _load_weight(self, state: dict[str, torch.Tensor]) -> int:
        """Take the weight from ``state``; returns ``in_features``."""
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

    @classmethod
    def _quantized_input(cls, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``onednn`` / ``gemv`` activation quantization: ``x2`` ``[M, in]`` float32 ->
        (``q + 128`` ``[M, in]`` uint8 in this thread's work buffer, valid until the next INT8
        layer runs on the thread; the scales ``[M, 1]``). The own kernel's one pass where it runs
        (``kernels.kernel_status().quantize_tokens``, on a contiguous copy of a strided input; the
        same bits), else PyTorch's operators."""
        qx = _scratch_tensor("u8", x2.shape, torch.uint8)
        quantize = kernel_status().quantize_tokens
        if quantize is not None:
            x_scale = torch.empty(x2.shape[0], 1, dtype=torch.float32)
            quantize(x2.contiguous(), qx, x_scale)
            return qx, x_scale
        x_scale, inv = cls._token_scales(x2)
        # round(x / scale) + 128 as uint8: x * inv lies in [-127, 127], so + 128.5 is positive
        # and the float -> uint8 conversion's truncation rounds half up, in two passes.
        shifted = torch.addcmul(_HALF_OFFSET, x2, inv, out=_scratch_tensor("f32", x2.shape, torch.float32))
        return qx.copy_(shifted), x_scale

    @staticmethod
    def _rescaled(y: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``y * x_scale (+ bias)`` in ``y``'s storage (``y`` ``[M, N]`` float32, already times the
        weight scales; ``x_scale`` ``[M, 1]``; ``bias`` ``[N]`` or None)."""
        if bias is None:
            return y.mul_(x_scale)
        return torch.addcmul(bias, y, x_scale, out=y)

    def _finish(self, y: torch.Tensor, x_scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return self._rescaled(y, x_scale, self.bias).to(dtype).reshape(*shape[:-1], self.out_features)


def pack_per_channel_weight(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The own per-channel GEMM's weight (``csrc/kernels.h``): ``q`` ``[N, K]`` int8 within
    +-``kernels.GEMM_WEIGHT_MAX``, ``K`` a multiple of 4 -> ``(weight [N'/32, K/4, 32, 4] int8,
    weight_offset [N'] int32)``, ``N'`` = ``N`` rounded up to 32 (zero weights past ``N``) and
    ``weight_offset`` = 128 x each row's sum (the activations' zero point).

    Raises:
        ValueError: ``q`` is not ``[N, K]`` int8 with ``K`` a multiple of 4, or holds a weight
            beyond +-63 (its products would saturate ``vpmaddubsw``'s 16-bit pair sums).
    """
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % 4 != 0:
        raise ValueError(f"q: [N, K] int8 with K a multiple of 4, got {q.dtype} {tuple(q.shape)}")
    if q.numel() and (int(q.max()) > GEMM_WEIGHT_MAX or int(q.min()) < -GEMM_WEIGHT_MAX):
        raise ValueError(f"weights beyond +-{GEMM_WEIGHT_MAX}: the own per-channel GEMM would saturate")
    n, k = q.shape
    padded = torch.zeros(_ceil_to(n, GEMM_PANEL), k, dtype=torch.int8)
    padded[:n] = q
    weight = padded.view(-1, GEMM_PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return weight, torch.sum(padded, dim=1, dtype=torch.int32).mul_(128)


def unpack_per_channel_weight(weight: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_per_channel_weight``'s ``q`` ``[n, K]`` int8 back from its packed ``weight``."""
    panels, groups = weight.shape[:2]
    return weight.permute(0, 2, 1, 3).reshape(panels * GEMM_PANEL, groups * 4)[:n].contiguous()


class OneDnnInt8Linear(_PerTokenInt8Linear):
    """``y = x W^T + b``, backend ``onednn``: per-token int8 activations, per-channel int8
    weights, oneDNN's u8 x s8 -> s32 GEMM (see the module docstring).

    Input ``[..., in_features]`` of any float dtype; output in the input's dtype.

    ``pack_row_groups`` packs the weight as several oneDNN weights, one per group of output rows;
    ``row_group_outputs`` then gives each group's outputs in turn from one quantization of the
    input, so a caller that consumes them group by group never holds the whole output (the vision
    attention's ``qkv``: ``engine.vision``). Each output is computed by the same integer dot product
    and the same float steps whatever the grouping, so the values are bit-identical (tested).

    Where ``kernels.per_channel_gemm_status()`` has the own AVX2 GEMM (the avx2 class) and the
    weights are 7-bit (oneDNN without VNNI), the weight is packed for it instead
    (``pack_per_channel_weight``), and it computes the outputs with the row scales and the bias
    fused: oneDNN's GEMM and ``_rescaled``'s bits (tested).
    """

    backend = "onednn"
    row_groups: torch.Tensor | None = None  # [groups, rows] int64 output rows of each pack, or None: one pack

    def _pack(self, q: torch.Tensor) -> None:
        # the own GEMM's (weight, weight_offset) or oneDNN's blocked layout; neither is a buffer
        gemm = per_channel_gemm_status().gemm
        self._gemm = gemm if self.weight_max <= GEMM_WEIGHT_MAX and q.shape[1] % 4 == 0 else None

        def pack(rows: torch.Tensor) -> Any:  # a (weight, weight_offset) pair or a oneDNN packed tensor
            return pack_per_channel_weight(rows) if self._gemm else torch.ops.onednn.qlinear_prepack(rows, None)

        self._packs: list[Any]
        if self.row_groups is None:
            self._packs = [pack(q)]
            self._group_state = []
        else:
            self._packs = [pack(q[rows].contiguous()) for rows in self.row_groups]
            self._group_state = [
                (self.weight_scale[rows], None if self.bias is None else self.bias[rows]) for rows in self.row_groups
            ]

    @property
    def own_gemm(self) -> bool:
        """Whether this layer runs on the own per-channel GEMM (else on oneDNN's)."""
        return self._gemm is not None

    def pack_row_groups(self, row_groups: torch.Tensor) -> None:
        """Pack the weight again as one weight per row group (oneDNN's or the own GEMM's).

        Args:
            row_groups: ``[groups, rows]`` int64, each output row exactly once.

        Raises:
            ValueError: ``row_groups`` is not a partition of the output rows.
        """
        every_row = torch.arange(self.out_features)
        if row_groups.dim() != 2 or not torch.equal(row_groups.flatten().sort().values, every_row):
            raise ValueError(f"row_groups must split the {self.out_features} output rows into equal groups")
        q = self._dense_weight()
        self.row_groups = row_groups.to(torch.int64)
        self._pack(q)

    def packed_bytes(self) -> int:
        """Bytes this layer holds outside its buffers: the packed int8 weights (one byte per weight)
        and, packed by row groups, the groups' rows and their copies of the scales and bias."""
        extra = [] if self.row_groups is None else [self.row_groups]
        extra += [t for state in self._group_state for t in state if t is not None]
        if self._gemm is not None:
            extra += [offset for _, offset in self._packs]
            weights = sum(weight.numel() for weight, _ in self._packs)
        else:
            weights = sum(pack.numel() for pack in self._packs)
        return weights + sum(t.numel() * t.element_size() for t in extra)

    def _dense_weight(self) -> torch.Tensor:
        """The int8 weight ``[out, in]`` in output-row order, read back from the packs."""
        # A oneDNN pack reads back as [in, rows] in plain layout. qlinear_prepack reads its input as
        # contiguous [out, in] whatever its strides (a transposed view packs the wrong matrix).
        if self._gemm is not None:
            sizes = [self.out_features] if self.row_groups is None else [len(rows) for rows in self.row_groups]
            dense = [unpack_per_channel_weight(weight, n) for (weight, _), n in zip(self._packs, sizes, strict=True)]
        else:
            dense = [pack.to_dense().t() for pack in self._packs]
        if self.row_groups is None:
            return dense[0].contiguous()
        q = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        for rows, part in zip(self.row_groups, dense, strict=True):
            q[rows] = part
        return q

    def _weight_state(self) -> dict[str, torch.Tensor]:
        # Stored [out, in], as quantized, to be packed again when loaded: the plain tensor as it is
        # gives the same outputs but made decode GEMMs ~2x slower.
        state = {"weight_q": self._dense_weight()}
        if self.row_groups is not None:
            state["row_groups"] = self.row_groups
        return state

    def _load_weight(self, state: dict[str, torch.Tensor]) -> int:
        self.row_groups = state.get("row_groups")
        self._pack(state["weight_q"].contiguous())
        return state["weight_q"].shape[1]

    def _group_output(self, qx: torch.Tensor, x_scale: torch.Tensor, group: int) -> torch.Tensor:
        """``[M, rows]`` float32 outputs of pack ``group`` (scaled, bias added)."""
        pack = self._packs[group]
        weight_scale, bias = (self.weight_scale, self.bias) if self.row_groups is None else self._group_state[group]
        if self._gemm is not None:
            weight, weight_offset = pack
            return self._gemm(qx, weight, weight_offset, weight_scale, x_scale, bias, weight_scale.shape[0])
        return self._rescaled(_onednn_matmul(qx, pack, weight_scale, _zero_points(pack.shape[1])), x_scale, bias)

    def row_group_outputs(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        """Each row group's outputs ``[M, rows]`` (``x`` ``[M, in]``, any float dtype; outputs in
        its dtype), in ``row_groups`` order, from one quantization of ``x``. While the iterator is
        alive no other INT8 layer may run on this thread (the quantized input is in its work buffer).

        Raises:
            ValueError: the weight is packed whole (``pack_row_groups`` was not called).
        """
        if self.row_groups is None:
            raise ValueError("the weight is packed whole: call pack_row_groups first")
        qx, x_scale = self._quantized_input(x.float())
        for group in range(len(self._packs)):
            yield self._group_output(qx, x_scale, group).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        qx, x_scale = self._quantized_input(x.reshape(-1, shape[-1]).float())
        if self.row_groups is None:
            y = self._group_output(qx, x_scale, 0)
        else:
            y = torch.empty(qx.shape[0], self.out_features)
            for group, rows in enumerate(self.row_groups):
                y[:, rows] = self._group_output(qx, x_scale, group)
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


class IntMmInt8Linear(_PerTokenInt8Linear):
    """``y = x W^T + b``, backend ``int_mm``: per-token int8 activations, per-channel int8 weights,
    ``torch._int_mm`` s8 x s8 -> s32 (see the module docstring).

    Input ``[..., in_features]`` of any float dtype; output in the input's dtype.
    """

    backend = "int_mm"
    weight_t: torch.Tensor  # buffer [in, out] int8

    def _pack(self, q: torch.Tensor) -> None:
        self.register_buffer("weight_t", q.t().contiguous())  # [in, out] for _int_mm

    def _weight_state(self) -> dict[str, torch.Tensor]:
        return {"weight_t": self.weight_t}

    def _load_weight(self, state: dict[str, torch.Tensor]) -> int:
        self.register_buffer("weight_t", state["weight_t"])
        return state["weight_t"].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).float()
        x_scale, inv = self._token_scales(x2)
        scaled = torch.mul(x2, inv, out=_scratch_tensor("f32", x2.shape, torch.float32)).round_()
        qx = _scratch_tensor("i8", x2.shape, torch.int8).copy_(scaled)
        return self._finish(_scaled(_int_mm_matmul(qx, self.weight_t), self.weight_scale), x_scale, shape, dtype)


class GemvInt8Linear(_PerTokenInt8Linear):
    """``y = x W^T + b``, backend ``gemv``: the ``onednn`` backend's numerics (per-token int8
    activations rounded half up, per-channel int8 weights) on plain ``[out, in]`` int8 weights.

    1 to ``kernels.MAX_ROWS`` rows (decode steps) run the engine's own AVX-512 VNNI kernel
    (``engine.kernels``), which streams the weights once; more rows (prefill) run
    ``torch._int_mm`` on the same weights (a transposed view, no copy). Both give exactly the
    ``onednn`` backend's outputs (tested), so a sequence's tokens do not depend on which ran.
    Needs ``kernels.kernel_status().gemv`` (``resolve_int8_backend`` refuses ``gemv`` without it).

    Input ``[..., in_features]`` of any float dtype; output in the input's dtype.
    """

    backend = "gemv"
    weight_q: torch.Tensor  # buffers: [out, in] int8, [out] int32 (sum over in of each row)
    weight_sum: torch.Tensor

    def _pack(self, q: torch.Tensor) -> None:
        # Summed QUANTIZE_CHUNK_ROWS rows at a time: the sum widens its input to int32 first, and
        # whole, the 151,936-row head's widened copy took 0.54 GB (a +0.31 GB loading peak).
        weight_sum = torch.empty(q.shape[0], dtype=torch.int32)
        for start in range(0, q.shape[0], QUANTIZE_CHUNK_ROWS):
            rows = slice(start, start + QUANTIZE_CHUNK_ROWS)
            torch.sum(q[rows], dim=1, dtype=torch.int32, out=weight_sum[rows])
        self._set_weight(q.contiguous(), weight_sum)

    def _set_weight(self, q: torch.Tensor, weight_sum: torch.Tensor) -> None:
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_sum", weight_sum)
        self._kernel = kernel_status().gemv
        if self._kernel is not None:
            check_gemv_weight(q, weight_sum, self.weight_scale, self.bias)

    def _weight_state(self) -> dict[str, torch.Tensor]:
        # The sums are kept with the weight: summing the 494 M weights again cost ~1 s of every
        # warm start (benchmarks/README.md, "Memory and start-up").
        return {"weight_q": self.weight_q, "weight_sum": self.weight_sum}

    def _load_weight(self, state: dict[str, torch.Tensor]) -> int:
        self._set_weight(state["weight_q"], state["weight_sum"])
        return state["weight_q"].shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1]).float()
        if 1 <= x2.shape[0] <= MAX_ROWS and self._kernel is not None:
            y = self._kernel(x2.contiguous(), self.weight_q, self.weight_sum, self.weight_scale, self.bias)
            return y.to(dtype).reshape(*shape[:-1], self.out_features)
        qx, x_scale = self._quantized_input(x2)  # q + 128, as the onednn path
        signed = qx.view(torch.int8).bitwise_xor_(-128)  # the byte q + 128, top bit flipped, is q as int8
        y = _scaled(_int_mm_matmul(signed, self.weight_q.t()), self.weight_scale)
        return self._finish(y, x_scale, shape, dtype)


BLOCK = 32  # input values per scale: llama.cpp's Q8_0 block (QK8_0 in ggml-common.h)
TILE = 16  # output channels per packed weight tile (csrc/int8_block.cpp's kLanes)


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _blockwise_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per ``BLOCK`` consecutive values of each row, in
    the own kernel's layout.

    ``weight`` ``[N, K]`` of any float dtype -> (``packed`` ``[N'/16, K'/4, 16, 4]`` uint8, where
    ``packed[t, g, i, j] = q[16 t + i, 4 g + j] + 128``; ``scale`` ``[N'/16, K'/32, 16]`` float32,
    ``scale[t, b, i]`` the scale of row ``16 t + i``'s block ``b``), with ``N'`` and ``K'`` ``N``
    and ``K`` rounded up to 16 and 32 (padding: zero weights, scale 0). ``q = round(w / scale)``
    (half to even) in -127..127, ``scale = max|w_block| / 127``. ``QUANTIZE_CHUNK_ROWS`` rows at
    a time (float32 temporaries of a few MB).
    """
    n, k = weight.shape
    n_pad, k_pad = _ceil_to(n, TILE), _ceil_to(k, BLOCK)
    packed = torch.empty(n_pad // TILE, k_pad // 4, TILE, 4, dtype=torch.uint8)
    scale = torch.empty(n_pad // TILE, k_pad // BLOCK, TILE, dtype=torch.float32)
    for start in range(0, n_pad, QUANTIZE_CHUNK_ROWS):
        rows = min(QUANTIZE_CHUNK_ROWS, n_pad - start)
        w = torch.zeros(rows, k_pad)
        w[: max(0, min(rows, n - start)), :k] = weight.detach()[start : start + rows]
        blocks = w.view(rows, k_pad // BLOCK, BLOCK)
        s = blocks.abs().amax(dim=2) / 127  # [rows, K'/32]
        q = torch.round(blocks / s.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp_(-127, 127)
        tiles = slice(start // TILE, (start + rows) // TILE)
        packed[tiles] = q.add_(128).view(rows // TILE, TILE, k_pad // 4, 4).permute(0, 2, 1, 3)
        scale[tiles] = s.view(rows // TILE, TILE, k_pad // BLOCK).permute(0, 2, 1)
    return packed, scale


def fma_float32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32 (a fused multiply-add), for float32 tensors that
    broadcast together, whatever PyTorch's build fuses.

    In float64 the product is exact (24 + 24 bits); the sum is rounded to odd there (an inexact
    result with an even last bit moves one ulp toward the exact sum, from TwoSum's error term), and
    float64 round-to-odd followed by rounding to float32 gives the correctly rounded result (53 >=
    2 * 24 + 2 bits; Boldo and Melquiond, "Emulation of FMA and correctly rounded sums", 2008).
    Finite inputs only are exact (non-finite ones give a non-finite result).
    """
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    virtual = s - p
    error = (p - (s - virtual)) + (cd - virtual)
    inexact_even = (error != 0) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(error > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(inexact_even, torch.nextafter(s, toward), s).float()


def block_int8_reference(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """The block-wise INT8 linear's arithmetic (``csrc/kernels.h``) in PyTorch, bit for bit: the
    kernels' test oracle, and what a ``BlockInt8Linear`` runs where the compiled kernels cannot be
    loaded (``kernels.kernel_status``).

    The same integers (activation blocks quantized as the kernels do: ``x * (127 / max|x_block|)``
    rounded half to even, saturated to -127..127 with NaN and values past int32 at -127; the
    products of 32 values summed exactly, in float32, whose 24-bit mantissa holds every such sum:
    ``32 * 127 * 127 < 2**24``) and the same float steps per block and output (the scale product,
    then a fused multiply-add into the running sum, ``fma_float32``, blocks in order; then the
    bias). Slow: each call unpacks the weight, ``QUANTIZE_CHUNK_ROWS`` rows at a time.

    Args:
        x: ``[M, K]`` float32.
        packed, scale: ``_blockwise_int8``'s layout.
        bias: ``[N]`` float32 or None.
        out_features: ``N``.

    Returns:
        ``[M, N]`` float32.
    """
    m, k = x.shape
    tiles, groups = packed.shape[:2]
    k_pad = groups * 4
    blocks = k_pad // BLOCK
    xb = F.pad(x, (0, k_pad - k)).view(m, blocks, BLOCK)
    amax = xb.abs().amax(dim=2)  # [M, B]
    # 127 / amax as a division (a Python number over a tensor is its reciprocal times 127: another rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    v = xb * inv[..., None]
    # the x86 conversion: NaN and values outside int32 become INT32_MIN, then saturated to -127
    qx = torch.where(v.abs() < 2.0**31, torch.round(v), torch.full_like(v, -127.0)).clamp_(-127, 127)
    qx = qx.transpose(0, 1)  # [B, M, 32]
    x_scale = amax / 127.0
    y = torch.empty(m, out_features)
    step = QUANTIZE_CHUNK_ROWS // TILE
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        n = (t1 - t0) * TILE
        w = packed[t0:t1].permute(2, 0, 1, 3).reshape(TILE, t1 - t0, blocks, BLOCK).float().sub_(128)
        dots = torch.bmm(qx, w.permute(2, 3, 1, 0).reshape(blocks, BLOCK, n))  # [B, M, n], n = (t, i)
        s = scale[t0:t1].permute(1, 0, 2).reshape(blocks, n)  # [B, n]
        acc = torch.zeros(m, n)
        for b in range(blocks):
            acc = fma_float32(dots[b], s[b] * x_scale[:, b : b + 1], acc)
        cols = slice(t0 * TILE, min(out_features, t1 * TILE))
        y[:, cols] = acc[:, : cols.stop - cols.start]
    return y if bias is None else y.add_(bias)


class BlockInt8Linear(nn.Module):
    """``y = x W^T + b`` with int8 weights and activations scaled per block of ``BLOCK`` input
    values (``Int8BlockConfig``; llama.cpp's Q8_0 granularity), any number of rows.

    Runs the own kernel (``kernels.kernel_status().block``: the fastest instruction-set path the
    CPU allows, arithmetic in ``csrc/kernels.h``), else ``block_int8_reference`` (the same
    arithmetic in PyTorch, bit for bit, much slower). Input ``[..., in_features]`` of any float
    dtype; output in its dtype.
    Weight memory: one byte per weight plus a float32 scale per 32 (1.125 bytes per weight).
    """

    weight_packed: torch.Tensor  # buffers: [N'/16, K'/4, 16, 4] uint8, [N'/16, K'/32, 16] float32
    weight_scale: torch.Tensor
    # each output row's arithmetic is its own and the weight is used as stored: a caller may split
    # the rows over calls and get the same bits at no extra weight work (model.FeedForward)
    rows_independent = True
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        packed, scale = _blockwise_int8(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._set(packed, scale, bias, linear.in_features, linear.out_features)

    def _set(
        self, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
    ) -> None:
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self._bind()

    def _bind(self) -> BoundBlockLinear | None:
        """Bind the own kernel to the layer's current buffers and return it
        (``kernels.bind_block_linear``, which checks them; None where it does not run, the buffers
        then checked here, as ``block_int8_reference`` reads the same layout).

        Raises:
            ValueError: a buffer the kernel cannot read (``kernels.check_block_weight``).
        """
        tensors = (self.weight_packed, self.weight_scale, self.bias)
        self._bound = bind_block_linear(*tensors, self.out_features, self.in_features)
        if self._bound is None:
            check_block_weight(*tensors, self.out_features)
        self._bound_to = tensors
        return self._bound

    def __getstate__(self) -> dict:
        """The module's state without its bound kernel (a compiled module's handle, which neither
        pickles nor deep-copies); ``__setstate__`` binds the copy to its own buffers."""
        state = self.__dict__.copy()
        state.pop("_bound", None)
        state.pop("_bound_to", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._bind()

    def prepared_state(self) -> dict[str, torch.Tensor]:
        """``weight_packed``, ``weight_scale``, ``shape`` (``[out, in]`` int64) and, if any,
        ``bias`` ``[out]`` float32 (see ``from_prepared``)."""
        state = {
            "weight_packed": self.weight_packed,
            "weight_scale": self.weight_scale,
            "shape": torch.tensor([self.out_features, self.in_features]),
        }
        if self.bias is not None:
            state["bias"] = self.bias
        return state

    @classmethod
    def from_prepared(cls, state: dict[str, torch.Tensor]) -> BlockInt8Linear:
        """The layer ``prepared_state`` described (the same outputs, bit for bit).

        Raises:
            KeyError: a tensor is missing.
        """
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        out_features, in_features = (int(v) for v in state["shape"])
        layer._set(state["weight_packed"], state["weight_scale"], state.get("bias"), in_features, out_features)
        return layer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={BLOCK}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound, buffers, bound_to = self._bound, self._buffers, self._bound_to
        if bound is not None and (
            buffers["weight_packed"] is not bound_to[0]
            or buffers["weight_scale"] is not bound_to[1]
            or buffers["bias"] is not bound_to[2]
        ):
            bound = self._bind()  # a buffer replaced since (Module.to, assignment): checked and bound again
        if bound is None:
            shape = x.shape
            y = block_int8_reference(x.reshape(-1, shape[-1]).float().contiguous(), self.weight_packed,
                                     self.weight_scale, self.bias, self.out_features)  # fmt: skip
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if x.dtype == torch.float32 and x.is_contiguous():  # a float32 model's every call, ~97 a decode step
            return bound(x)
        return bound(x.float().contiguous()).to(x.dtype)


class _BufferLinear(nn.Module):
    """A linear layer whose state is all buffers (rebuilt by ``_from_buffers``)."""

    in_features: int
    out_features: int


class Int8WeightOnlyLinear(_BufferLinear):
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

    def prepared_state(self) -> dict[str, torch.Tensor]:
        """``weight_q`` ``[out, in]`` int8, ``weight_scale`` ``[out]`` and, if any, ``bias`` (see
        ``from_prepared``)."""
        return _buffers(self)

    @classmethod
    def from_prepared(cls, state: dict[str, torch.Tensor]) -> Int8WeightOnlyLinear:
        """The layer ``prepared_state`` described.

        Raises:
            KeyError: a tensor is missing.
        """
        return _from_buffers(cls, state, ("weight_q", "weight_scale"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_q.to(x.dtype) * self.weight_scale.to(x.dtype)[:, None]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)


# Bf16WeightsLinear: inputs of at most this many rows (decode steps) upcast the weight a chunk of
# output rows at a time, each chunk multiplied while it is still in cache, instead of writing and
# re-reading a whole float32 copy (for MinerU2.5's head, 151,936 x 896: 545 MB per step). One
# decode step of that head, 1 thread, AMD EPYC (2026-12-04): 312 ms whole, 33 ms by chunks. The
# products are the same; their float32 sums follow the order the GEMM picks per shape: bit for
# bit the whole weight's on that EPYC, a few float32 ulps apart for some row counts on an AMX Xeon
# (tests/test_quantize.py bounds it, every row count 1..16, the model's shapes). Larger inputs
# (prefill, vision) cast the whole weight once per call, as before.
UPCAST_CHUNK_MAX_ROWS = 16
# Bytes of float32 weight per upcast chunk (about the L2 cache of one core), in multiples of 256
# output rows.
UPCAST_CHUNK_BYTES = 1 << 20


class Bf16WeightsLinear(_BufferLinear):
    """``y = x W^T + b`` with ``W`` stored in bfloat16 and cast to ``x``'s dtype per call.

    ``x`` ``[..., in]`` float32 or bfloat16 -> ``[..., out]`` in ``x``'s dtype. Upcasting a
    bfloat16 value is exact, so the output is ``F.linear`` on a float32 copy of ``W`` at half the
    memory (bit for bit above ``UPCAST_CHUNK_MAX_ROWS`` rows); inputs of up to that many rows cast
    ``W`` in chunks of output rows, the same products summed in the order the GEMM picks for a
    chunk (see there).
    """

    weight_bf16: torch.Tensor  # buffers: [out, in] bfloat16, [out] float32 or None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def prepared_state(self) -> dict[str, torch.Tensor]:
        """``weight_bf16`` ``[out, in]`` and, if any, ``bias`` (see ``from_prepared``)."""
        return _buffers(self)

    @classmethod
    def from_prepared(cls, state: dict[str, torch.Tensor]) -> Bf16WeightsLinear:
        """The layer ``prepared_state`` described.

        Raises:
            KeyError: a tensor is missing.
        """
        return _from_buffers(cls, state, ("weight_bf16",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = x.numel() // self.in_features
        if x.dtype == self.weight_bf16.dtype or rows > UPCAST_CHUNK_MAX_ROWS or rows == 0:
            return F.linear(x, self.weight_bf16.to(x.dtype), bias)
        x2 = x.reshape(rows, self.in_features)
        step = max(256, UPCAST_CHUNK_BYTES // (4 * self.in_features) // 256 * 256)
        parts = []
        for start in range(0, self.out_features, step):
            part = slice(start, start + step)
            parts.append(F.linear(x2, self.weight_bf16[part].to(x.dtype), None if bias is None else bias[part]))
        return torch.cat(parts, dim=1).view(*x.shape[:-1], self.out_features)


def _buffers(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in layer.named_buffers(recurse=False) if t is not None}


M = TypeVar("M", bound=_BufferLinear)


def _from_buffers(cls: type[M], state: dict[str, torch.Tensor], names: tuple[str, ...]) -> M:
    """A buffer-only layer of type ``cls`` holding the tensors ``names`` of ``state`` and its
    optional ``bias``; ``in_features`` / ``out_features`` from the ``[out, in]`` weight ``names[0]``."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    for name in names:
        layer.register_buffer(name, state[name])
    layer.register_buffer("bias", state.get("bias"))
    layer.out_features, layer.in_features = state[names[0]].shape
    return layer


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
    else ``"int_mm"`` without oneDNN's quantized linear ops, else ``"torch_ao"``; ``"gemv"`` ->
    ``"onednn"`` where the own kernel is not available (``kernels.kernel_status``); others as given.

    Raises:
        ValueError: unknown backend.
    """
    if backend not in INT8_BACKENDS:
        raise ValueError(f"backend must be one of {INT8_BACKENDS}, got {backend!r}")
    if backend == "gemv" and (kernel_status().gemv is None or int8_weight_max("int_mm") != int8_weight_max("onednn")):
        return "onednn"  # the same numerics, bit for bit (gemv's prefill GEMM is torch._int_mm)
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
    kernel = {
        "onednn": per_channel_gemm_status().reason if int8_weight_max("onednn") <= GEMM_WEIGHT_MAX else ONEDNN_GEMM,
        "gemv": f"own AVX-512 VNNI u8s8s32 GEMV (1-{MAX_ROWS} rows), torch._int_mm s8s8s32 above",
        "int_mm": "torch._int_mm s8s8s32",
    }[backend]
    bits = 8 if int8_weight_max(backend) == 127 else 7
    return f"{backend}: int8 weights per channel ({bits}-bit); int8 activations per token; {kernel}"


def _int8_dynamic(linear: nn.Linear, config: Int8DynamicConfig) -> nn.Module:
    backend = resolve_int8_backend(config.backend)
    if backend == "torch_ao":
        return _TorchAoDynamicLinear(linear)
    layer = {"onednn": OneDnnInt8Linear, "gemv": GemvInt8Linear, "int_mm": IntMmInt8Linear}[backend]
    return layer(linear)


_HANDLERS: dict[type, Callable[[nn.Linear, object], nn.Module]] = {
    Int8DynamicConfig: _int8_dynamic,  # type: ignore[dict-item]
    Int8WeightOnlyConfig: lambda linear, _: Int8WeightOnlyLinear(linear),
    Int8BlockConfig: lambda linear, _: BlockInt8Linear(linear),
    Bf16WeightsConfig: lambda linear, _: Bf16WeightsLinear(linear),
}


def _handler(config: object) -> Callable[[nn.Linear, object], nn.Module]:
    handler = _HANDLERS.get(type(config))
    if handler is None:
        raise TypeError(
            f"no quantization handler for {type(config).__name__}; known: {[t.__name__ for t in _HANDLERS]}"
        )
    return handler


def quantize_linear(linear: nn.Linear, config: object) -> nn.Module:
    """``linear``'s replacement under ``config`` (an instance of a registered config type).

    Raises:
        TypeError: no handler is registered for ``type(config)``.
    """
    return _handler(config)(linear, config)


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
    handler = _handler(config)
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
