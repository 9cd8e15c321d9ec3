"""The engine's own compiled kernels, built when the package is installed: the block-wise INT8 linear
of the language model (``int8-block``, the fast preset's), the per-token INT8 GEMV of decode rows
(``int8-dynamic`` on the ``gemv`` backend), the language model's decode-step attention
(``KernelStatus.decode_attention``) and, for the fast preset's block-wise language model, its
RMSNorm, SiLU-gated product and a whole decode step in one call (``KernelStatus.decoder``; these two
on the ``avx512_vnni`` and ``avx2`` paths, the same bits), the per-token INT8 quantization of the
per-channel INT8 linears' activations (``KernelStatus.quantize_tokens``, the vision encoder's
linears; the same paths, PyTorch's bits), the vision encoder's bfloat16 and float32 attentions
(``attention_status``, ``f32_attention_status``) and, on the avx2 class, its per-channel INT8
linears' GEMM (``per_channel_gemm_status``: oneDNN's outputs bit for bit).

The C++ sources are in ``csrc/`` (``csrc/kernels.h`` states the block kernel's arithmetic), built by
``setup.py`` into the extension module ``mineru_fast.engine._kernels`` (CPython's limited API, no
PyTorch headers: tensors cross as raw pointers, so one build serves every PyTorch release). Every
instruction-set path is compiled in, and the fastest one the CPU class allows runs:

- ``avx512_vnni``: ``vpdpbusd`` on 16 outputs at a time (AVX-512 VNNI CPUs: Ice Lake and later
  Xeons, AMD Zen 4 and later);
- ``avx2``: ``vpmaddubsw`` + ``vpmaddwd`` (AVX2 + FMA CPUs: Haswell and later, AMD Zen 1 to 3);
- ``portable``: plain C++ (any CPU).

All three give the same bits for the block kernel (the same integers, the same float steps in the
same order; tested), and so do this module's PyTorch form of that arithmetic
(``quantize.block_int8_reference``), which runs only where the extension cannot be loaded or with
``MINERU_FAST_OWN_KERNELS=0``: a layer's quantization never changes with the machine. The CPU class
is ``runtime.cpu.isa_class`` (so the ISA caps ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` that
simulate an older CPU lower the path too), and ``MINERU_FAST_KERNEL_PATH`` picks a lower path by
name. The GEMV exists on the ``avx512_vnni`` path only; elsewhere ``torch._int_mm`` gives its
outputs (the same numerics, see ``quantize.GemvInt8Linear``). The decode attention runs on the
``avx512_vnni`` and ``avx2`` paths (the same bits; not the portable one, where PyTorch's operators
run it).

A development checkout (where ``csrc/`` sits beside this file) checks that the module was built from
the sources there (``SOURCE_DIGEST``, written by ``setup.py``): a stale build is not used, and the
status says to run ``pip install -e .`` again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from mineru_fast.runtime.cpu import ISA_CLASSES, Topology, isa_class, read_topology

logger = logging.getLogger(__name__)

OWN_KERNELS_ENV = "MINERU_FAST_OWN_KERNELS"
PATH_ENV = "MINERU_FAST_KERNEL_PATH"
PATHS = ("avx512_vnni", "avx2", "portable")  # fastest first; ids 2, 1, 0 in csrc/module.cpp
_PATH_ID = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
_PATH_CLASS = {"avx512_vnni": "avx512_vnni", "avx2": "avx2", "portable": "baseline"}  # lowest ISA class of each
CSRC = Path(__file__).parent / "csrc"
MAX_ROWS = 16  # rows of activations per GEMV call (csrc/kernels.h's kGemvMaxRows)

BlockLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]
GemvLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
TokenQuantize = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
DecodeAttention = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        int,
        torch.Tensor,
    ],
    None,
]


@dataclass(frozen=True)
class KernelStatus:
    """Which own kernels run here, and why not when they do not.

    Attributes:
        path: the block kernel's instruction-set path (one of ``PATHS``), or None when the
            extension is not used (then ``block`` is None and ``quantize.block_int8_reference``, the
            same arithmetic in PyTorch, runs).
        reason: one line: what runs the block-wise layers (the path), or why the compiled kernels
            do not.
        block: ``block(x [M, K] float32 contiguous, weight [N'/16, K'/4, 16, 4] uint8, weight_scale
            [N'/16, K'/32, 16] float32, bias [N] float32 or None, n_size N) -> [M, N] float32`` for any
            M (layout: ``quantize.BlockInt8Linear``; checked by ``check_block_weight``), or None.
        gemv: ``gemv(x [M, K] float32 contiguous, weight [N, K] int8, weight_sum [N] int32,
            weight_scale [N] float32, bias [N] float32 or None) -> [M, N] float32`` for
            1 <= M <= ``MAX_ROWS`` (AVX-512 VNNI only), or None.
        gemv_reason: one line: what runs per-channel INT8 layers' decode rows (``gemv``), or why
            not (what ``engine.numerics["lm_decode_kernel"]`` says).
        decode_attention: ``decode_attention(qkv, cos, sin, k_cache, v_cache, positions, heads,
            out)``, the language model's attention for one decode step (``csrc/kernels.h``'s
            ``DecodeAttention``; the checks and shapes: ``_decode_attention``), on the
            ``avx512_vnni`` and ``avx2`` paths (the same bits), else None.
        decoder: the RMSNorm, the SiLU-gated product and a whole decode step of block-wise decoder
            layers in one call (``DecoderKernels``), on the paths of ``decode_attention``, else None.
        quantize_tokens: ``quantize_tokens(x, q, scale)``, the per-token INT8 quantization of the
            ``onednn`` and ``gemv`` linears' activations in one pass, PyTorch's operators there bit
            for bit (``csrc/kernels.h``'s token quantization; checks: ``_quantize_tokens``), on the
            ``avx512_vnni`` and ``avx2`` paths, else None.
    """

    path: str | None
    reason: str
    block: BlockLinear | None = None
    gemv: GemvLinear | None = None
    gemv_reason: str = ""
    decode_attention: DecodeAttention | None = None
    decoder: DecoderKernels | None = None
    quantize_tokens: TokenQuantize | None = None


def source_digest(csrc: Path | None = None) -> str:
    """SHA-256 of the kernel sources in ``csrc`` (default ``CSRC``; names and bytes, in name order),
    as ``setup.py`` records it in the module it builds."""
    digest = hashlib.sha256()
    for path in sorted((csrc or CSRC).iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _disabled() -> bool:
    return os.environ.get(OWN_KERNELS_ENV, "").strip().lower() in ("0", "off", "false", "no")


def allowed_paths(topology: Topology | None = None) -> tuple[str, ...]:
    """The paths (of ``PATHS``, fastest first) the CPU class of ``topology`` (default: this machine,
    caps included) allows, lowered further by ``MINERU_FAST_KERNEL_PATH``.

    Raises:
        ValueError: ``MINERU_FAST_KERNEL_PATH`` names no path.
    """
    rank = ISA_CLASSES.index
    cls = rank(isa_class((topology or read_topology()).isa).name)
    paths = tuple(p for p in PATHS if rank(_PATH_CLASS[p]) <= cls)
    chosen = os.environ.get(PATH_ENV, "").strip().lower()
    if chosen in ("", "auto"):
        return paths
    if chosen not in PATHS:
        raise ValueError(f"{PATH_ENV}={chosen!r}: one of auto, {', '.join(PATHS)}")
    return paths[paths.index(chosen) :] if chosen in paths else ()


def _load_module() -> ModuleType:
    """The built extension, checked against the sources of a development checkout.

    Raises:
        ImportError: not built (or built for another platform), or built from other sources.
    """
    from mineru_fast.engine import _kernels  # type: ignore[attr-defined]  # built by setup.py

    if CSRC.is_dir() and _kernels.SOURCE_DIGEST != source_digest(CSRC):
        raise ImportError(f"built from other sources than {CSRC}: run `pip install -e .` again to rebuild it")
    return _kernels


def check_block_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, n_size: int
) -> None:
    """Check a block-wise layer's tensors against the kernel's layout before it ever reads them.

    Raises:
        ValueError: a dtype, a shape or a memory layout the kernel cannot read, or a weight outside
            -127..127 (a stored 0, q = -128: the avx2 path's decode form negates weights with
            ``vpsignb``, which cannot negate -128, so such a weight would give other bits there).
    """
    if weight.dtype != torch.uint8 or weight.dim() != 4 or weight.shape[2:] != (16, 4) or not weight.is_contiguous():
        raise ValueError(f"weight: [N/16, K/4, 16, 4] contiguous uint8, got {weight.dtype} {tuple(weight.shape)}")
    tiles, groups = weight.shape[:2]
    if groups % 8 or not (tiles - 1) * 16 < n_size <= tiles * 16:
        raise ValueError(f"weight {tuple(weight.shape)} does not hold {n_size} outputs in 32-value blocks")
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (tiles, groups // 8, 16):
        raise ValueError(f"weight_scale: [{tiles}, {groups // 8}, 16] float32, got {tuple(weight_scale.shape)}")
    if not weight_scale.is_contiguous():
        raise ValueError("weight_scale: contiguous")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n_size,) or not bias.is_contiguous()):
        raise ValueError(f"bias: [{n_size}] contiguous float32")
    if int(weight.min()) == 0:  # a reduction: no mask as large as the weight
        raise ValueError("weight: a stored 0 (q = -128); block-wise weights are -127..127 (+ 128)")


def _check_rows(x: torch.Tensor, k_size: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k_size or not x.is_contiguous():
        raise ValueError(f"x: [M, {k_size}] contiguous float32, got {x.dtype} {tuple(x.shape)}")


def block_kernel(path: str) -> BlockLinear:
    """The block kernel on one instruction-set path, whatever the CPU class would choose (tests and
    benchmarks compare the paths; ``kernel_status().block`` is what the engine runs).

    Raises:
        ImportError: the extension is not built (or stale).
        ValueError: ``path`` is not one of ``PATHS``, or this CPU cannot run it.
    """
    module = _load_module()
    if path not in module.cpu_paths():
        raise ValueError(f"the {path!r} path does not run on this CPU (it runs {', '.join(module.cpu_paths())})")
    return _block_linear(module, path)


def _block_linear(module: ModuleType, path: str) -> BlockLinear:
    path_id = _PATH_ID[path]

    def block(
        x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, n_size: int
    ) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"x: [M, K] contiguous float32, got {x.dtype} {tuple(x.shape)}")
        m_size = x.size(0)
        y = torch.empty(m_size, n_size, dtype=torch.float32)  # whatever the default dtype: the kernel writes float32
        module.block_linear(
            path_id,
            torch.get_num_threads(),
            x.data_ptr(),
            m_size,
            x.size(1),
            weight.data_ptr(),
            weight.size(0),
            weight.size(1) * 4,
            weight_scale.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            n_size,
            y.data_ptr(),
        )
        return y

    return block


class BoundBlockLinear:
    """The block kernel with one layer's tensors bound (``bind_block_linear``): ``call(x)`` for
    ``x`` ``[..., K]`` contiguous float32 -> ``[..., N]`` float32, leading dimensions kept; the
    same bits as ``kernel_status().block``. It holds the layer's tensors (``tensors``: weight,
    scale, bias or None); a tensor whose storage moved in place since (``share_memory_``, ``set_``)
    is checked and its pointers taken again before the kernel reads it.

    Raises:
        ValueError: (from a call) an ``x`` of another dtype, last dimension, layout or device, or
            a bound tensor whose storage moved in place into one the kernel cannot read.
    """

    __slots__ = ("_module", "_path_id", "_pointers", "_storages", "_k_size", "_n_size", "tensors")

    def __init__(self, module: ModuleType, path_id: int, tensors: tuple, k_size: int, n_size: int) -> None:
        self._module, self._path_id, self.tensors = module, path_id, tensors
        self._k_size, self._n_size = k_size, n_size
        self._take_pointers()

    def _take_pointers(self) -> None:
        weight, weight_scale, bias = self.tensors
        check_block_weight(weight, weight_scale, bias, self._n_size)
        k_pad = weight.shape[1] * 4
        if not k_pad - 32 < self._k_size <= k_pad:
            raise ValueError(f"weight {tuple(weight.shape)} does not hold {self._k_size} inputs in 32-value blocks")
        self._pointers = (weight.data_ptr(), weight.size(0), k_pad, weight_scale.data_ptr(),
                          0 if bias is None else bias.data_ptr())  # fmt: skip
        # the storages the pointers point into, held: while bound, no other storage can take their
        # addresses, so a tensor whose pointer still matches still points into this storage
        self._storages = tuple(t.untyped_storage() for t in self.tensors if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (weight, weight_scale, bias), pointers = self.tensors, self._pointers
        if (
            weight.data_ptr() != pointers[0]
            or weight_scale.data_ptr() != pointers[3]
            or (bias is not None and bias.data_ptr() != pointers[4])
        ):
            self._take_pointers()
        k_size, n_size = self._k_size, self._n_size
        if x.dtype != torch.float32 or x.shape[-1] != k_size or not x.is_contiguous() or not x.is_cpu:
            raise ValueError(f"x: [..., {k_size}] contiguous float32 on the CPU, got {x.dtype} {tuple(x.shape)}")
        y = torch.empty(*x.shape[:-1], n_size, dtype=torch.float32)
        self._module.block_linear(self._path_id, torch.get_num_threads(), x.data_ptr(), x.numel() // k_size, k_size,
                                  *self._pointers, n_size, y.data_ptr())  # fmt: skip
        return y


def bind_block_linear(
    weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, n_size: int, k_size: int
) -> BoundBlockLinear | None:
    """The block kernel of ``kernel_status`` with one layer's tensors bound, or None where it does
    not run. The tensors are checked once here (``check_block_weight``, and ``k_size`` inputs
    against the weight's blocks); each call then checks its ``x`` and compares the tensors' data
    pointers with the bound ones (``BoundBlockLinear``), where a layer calling
    ``kernel_status().block`` passes its tensors and takes their pointers and sizes at every call,
    reshaping in and out (a decode step makes ~97 calls, and every microsecond outside the kernel is
    one of the step's).

    Raises:
        ValueError: as ``check_block_weight``, or ``k_size`` not in the weight's last block.
    """
    status = kernel_status()
    if status.path is None:
        return None
    return BoundBlockLinear(_load_module(), _PATH_ID[status.path], (weight, weight_scale, bias), k_size, n_size)


def _gemv_linear(module: ModuleType) -> GemvLinear:
    def gemv(
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_sum: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        n_size, k_size = weight.shape
        _check_rows(x, k_size)
        y = torch.empty(x.shape[0], n_size, dtype=torch.float32)
        module.gemv_linear(
            torch.get_num_threads(),
            x.data_ptr(),
            x.shape[0],
            k_size,
            weight.data_ptr(),
            weight_sum.data_ptr(),
            weight_scale.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            n_size,
            y.data_ptr(),
        )
        return y

    return gemv


def _quantize_tokens(module: ModuleType) -> TokenQuantize:
    def quantize_tokens(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows ``x`` ``[M, N]`` float32 (contiguous, CPU) -> ``q`` ``[M, N]`` uint8 (``x * 127 / a``
        rounded, halves up, ``+ 128``) and ``scale`` ``[M, 1]`` float32 (``a / 127``), both contiguous,
        written in place; ``a`` is the row's largest magnitude, at least ``127e-12`` (NaN for a row
        with a NaN). The arithmetic: ``csrc/kernels.h``.

        Raises:
            ValueError: a tensor of another dtype, shape, layout or device.
        """
        if not (x.is_cpu and q.is_cpu and scale.is_cpu):
            raise ValueError(f"CPU tensors only, got {x.device}, {q.device}, {scale.device}")
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"x: [M, N] contiguous float32, got {x.dtype} {tuple(x.shape)}")
        if q.dtype != torch.uint8 or q.shape != x.shape or not q.is_contiguous():
            raise ValueError(f"q: {tuple(x.shape)} contiguous uint8, got {q.dtype} {tuple(q.shape)}")
        if scale.dtype != torch.float32 or scale.shape != (x.shape[0], 1) or not scale.is_contiguous():
            raise ValueError(f"scale: ({x.shape[0]}, 1) contiguous float32, got {scale.dtype} {tuple(scale.shape)}")
        module.quantize_tokens(
            torch.get_num_threads(), x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scale.data_ptr()
        )

    return quantize_tokens


GEMM_PANEL = 32  # outputs per packed weight panel of the per-channel GEMM (csrc/kernels.h's kGemmPanel)
GEMM_WEIGHT_MAX = 63  # the per-channel GEMM's largest weight magnitude: vpmaddubsw's int16 pair sums stay exact


def check_per_channel_weight(weight: torch.Tensor, weight_offset: torch.Tensor, k_size: int) -> None:
    """Check a per-channel GEMM weight's layout (``csrc/kernels.h``; made by
    ``quantize.pack_per_channel_weight``): ``weight`` ``[N'/32, K/4, 32, 4]`` int8 and
    ``weight_offset`` ``[N']`` int32, contiguous, on the CPU.

    Raises:
        ValueError: another dtype, shape, layout or device.
    """
    panels = weight.shape[0] if weight.dim() == 4 else 0
    expected = (panels, k_size // 4, GEMM_PANEL, 4)
    if weight.dtype != torch.int8 or tuple(weight.shape) != expected or not weight.is_contiguous() or not weight.is_cpu:
        raise ValueError(f"weight: [N'/{GEMM_PANEL}, K/4, {GEMM_PANEL}, 4] contiguous int8 on the CPU, K = {k_size}")
    if weight_offset.dtype != torch.int32 or tuple(weight_offset.shape) != (panels * GEMM_PANEL,):
        raise ValueError(f"weight_offset: [{panels * GEMM_PANEL}] int32")
    if not weight_offset.is_contiguous() or not weight_offset.is_cpu:
        raise ValueError("weight_offset: contiguous, on the CPU")


PerChannelGemm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor
]


def _per_channel_gemm(module: ModuleType) -> PerChannelGemm:
    def gemm(
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_offset: torch.Tensor,
        weight_scale: torch.Tensor,
        x_scale: torch.Tensor,
        bias: torch.Tensor | None,
        n_size: int,
    ) -> torch.Tensor:
        """``x`` ``[M, K]`` uint8 (per-token ``q + 128``, contiguous), the packed weight and its
        offsets (``check_per_channel_weight``; weights within +-63, which the packing checks: larger
        ones saturate), ``weight_scale`` ``[N]`` float32, ``x_scale`` ``[M, 1]`` float32, ``bias``
        ``[N]`` float32 or None -> ``[M, N]`` float32: ``csrc/kernels.h``'s per-channel INT8 GEMM,
        the ``onednn`` backend's outputs bit for bit.

        Raises:
            ValueError: a tensor of another dtype, shape, layout or device.
        """
        if x.dtype != torch.uint8 or x.dim() != 2 or not x.is_contiguous() or not x.is_cpu:
            raise ValueError(f"x: [M, K] contiguous uint8 on the CPU, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        check_per_channel_weight(weight, weight_offset, k)
        if weight.shape[0] != -(-n_size // GEMM_PANEL):
            raise ValueError(f"weight: {weight.shape[0]} panels for {n_size} outputs")
        for name, t, shape in (("weight_scale", weight_scale, (n_size,)), ("x_scale", x_scale, (m, 1))):
            if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"{name}: {shape} contiguous float32 on the CPU, got {t.dtype} {tuple(t.shape)}")
        if bias is not None and (
            bias.dtype != torch.float32 or tuple(bias.shape) != (n_size,) or not bias.is_contiguous() or not bias.is_cpu
        ):
            raise ValueError(f"bias: [{n_size}] contiguous float32 on the CPU")
        y = torch.empty(m, n_size, dtype=torch.float32)
        module.per_channel_gemm(
            torch.get_num_threads(),
            x.data_ptr(),
            m,
            k,
            weight.data_ptr(),
            weight_offset.data_ptr(),
            weight.shape[0],
            weight_scale.data_ptr(),
            x_scale.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            y.data_ptr(),
            n_size,
        )
        return y

    return gemm


def per_channel_gemm_kernel() -> PerChannelGemm:
    """The own per-channel INT8 GEMM (``_per_channel_gemm``'s contract), whatever the CPU class would
    choose (tests run it on every CPU with AVX2; ``per_channel_gemm_status()`` is what the engine runs).

    Raises:
        ImportError: the extension is not built (or stale).
        ValueError: this CPU lacks AVX2 and FMA.
    """
    return _per_channel_gemm(_decode_path_module("avx2", "per-channel INT8 GEMM"))


@dataclass(frozen=True)
class GemmStatus:
    """Whether the own per-channel INT8 GEMM runs the ``onednn`` linears here, and why not when not.

    Attributes:
        gemm: ``per_channel_gemm_kernel()``'s callable, or None where oneDNN runs them.
        reason: one line, for ``quantize.int8_kernel_path``.
    """

    gemm: PerChannelGemm | None
    reason: str


ONEDNN_GEMM = "oneDNN u8s8s32"
OWN_GEMM = (
    "own AVX2 u8s8s32 GEMM where oneDNN has no VNNI (7-bit weights; oneDNN's outputs bit for bit), "
    "row scales and bias fused"
)


def per_channel_gemm_reason(class_name: str, status: KernelStatus, path: str | None) -> str:
    """What runs the ``onednn`` linears' GEMM on a CPU of class ``class_name`` whose kernels
    (``status``) run ``path``: ``OWN_GEMM`` on the avx2 class and path, else why oneDNN's does
    (one line, starting with ``ONEDNN_GEMM``)."""
    if class_name != "avx2":
        return f"{ONEDNN_GEMM}: the own per-channel GEMM is for the avx2 class"
    if status.block is None:
        return f"{ONEDNN_GEMM}: {status.reason}"
    if path != "avx2":
        return f"{ONEDNN_GEMM}: the own per-channel GEMM needs the kernels' avx2 path ({path} here)"
    return OWN_GEMM


@functools.cache
def per_channel_gemm_status() -> GemmStatus:
    """The own per-channel INT8 GEMM where the CPU class is ``avx2`` (caps included) and the kernels'
    path is ``avx2``, else why oneDNN's runs (``per_channel_gemm_reason``; cached per process;
    never raises). The ``onednn`` layers use it only where their weights are 7-bit
    (``quantize.int8_weight_max``: oneDNN without VNNI). On the AVX2 class a layout image's encoder
    pass took 0.90x and 0.95x the time on oneDNN in two runs (an AMX Xeon capped to AVX2, 2 threads,
    ``benchmarks/per_channel_gemm.py``); the AVX-512 classes keep oneDNN, whose AVX-512 GEMM is
    twice as wide."""
    status = kernel_status()
    reason = per_channel_gemm_reason(isa_class(read_topology().isa).name, status, status.path)
    return GemmStatus(per_channel_gemm_kernel() if reason == OWN_GEMM else None, reason)


DECODE_ATTENTION_PATHS = ("avx512_vnni", "avx2")  # the paths with an own decode attention


def decode_attention_kernel(path: str) -> DecodeAttention:
    """The decode attention on one instruction-set path (one of ``DECODE_ATTENTION_PATHS``), whatever
    the CPU class would choose (tests compare the paths; ``kernel_status().decode_attention`` is what
    the engine runs).

    Raises:
        ImportError: the extension is not built (or stale).
        ValueError: the path has no decode attention, or this CPU cannot run it.
    """
    return _decode_attention(_decode_path_module(path, "decode attention"), path)


def _decode_path_module(path: str, what: str) -> ModuleType:
    """The extension, where ``path`` is one of ``DECODE_ATTENTION_PATHS`` and this CPU runs it.

    Raises:
        ImportError: the extension is not built (or stale).
        ValueError: no ``what`` on that path, or this CPU cannot run it.
    """
    module = _load_module()
    if path not in DECODE_ATTENTION_PATHS or path not in module.cpu_paths():
        raise ValueError(f"no {what} on the {path!r} path here (this CPU runs {module.cpu_paths()})")
    return module


def _decode_attention(module: ModuleType, path: str) -> DecodeAttention:
    path_id = _PATH_ID[path]

    def decode_attention(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        row_slots: torch.Tensor,
        positions: torch.Tensor,
        heads: int,
        out: torch.Tensor,
    ) -> None:
        """Rotary embedding, KV write and attention of one decode step (``csrc/kernels.h``).

        Args:
            qkv: ``[B, (heads + 2 kv_heads) d]`` float32 contiguous, the ``wqkv`` output of the
                step's rows (query heads, then key heads, then value heads).
            cos, sin: ``[B, d]`` float32 contiguous, ``model.MRoPE``'s tables (``sin`` signed).
            k_cache, v_cache: ``[slots, kv_heads, max_len, d]`` float32 contiguous
                (``kv_cache.KVCache``); row ``b`` writes slot ``row_slots[b]`` at ``positions[b]``.
            row_slots: ``[B]`` int64 contiguous, each in ``0..slots-1``. Rows may share a slot
                (draft tokens at consecutive positions): every row writes before any attends.
            positions: ``[B]`` int64 contiguous; row ``b`` attends to positions ``0..positions[b]``
                of its slot.
            heads: query heads (a multiple of ``kv_heads``).
            out: ``[B, heads * d]`` float32 contiguous, written.

        Raises:
            ValueError: a dtype, shape or layout the kernel cannot read, or a position outside
                the cache.
        """
        slots, kv_heads, max_len, d = k_cache.shape
        batch = qkv.shape[0]
        shapes = {
            "qkv": (qkv, torch.float32, (batch, (heads + 2 * kv_heads) * d)),
            "cos": (cos, torch.float32, (batch, d)),
            "sin": (sin, torch.float32, (batch, d)),
            "k_cache": (k_cache, torch.float32, (slots, kv_heads, max_len, d)),
            "v_cache": (v_cache, torch.float32, (slots, kv_heads, max_len, d)),
            "row_slots": (row_slots, torch.int64, (batch,)),
            "positions": (positions, torch.int64, (batch,)),
            "out": (out, torch.float32, (batch, heads * d)),
        }
        for name, (t, dtype, shape) in shapes.items():
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"{name}: {list(shape)} contiguous {dtype}, got {t.dtype} {tuple(t.shape)}")
        module.decode_attention(
            path_id,
            torch.get_num_threads(),
            qkv.data_ptr(),
            batch,
            heads,
            kv_heads,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots,
            max_len,
            row_slots.data_ptr(),
            positions.data_ptr(),
            out.data_ptr(),
            d**-0.5,
        )

    return decode_attention


def decoder_kernels(path: str) -> DecoderKernels:
    """The decoder kernels on one instruction-set path (one of ``DECODE_ATTENTION_PATHS``), whatever
    the CPU class would choose (tests compare the paths; ``kernel_status().decoder`` is what the
    engine runs).

    Raises:
        ImportError: the extension is not built (or stale).
        ValueError: the path has no decoder kernels, or this CPU cannot run it.
    """
    return DecoderKernels(_decode_path_module(path, "decoder kernels"), path)


def _check_float_rows(name: str, x: torch.Tensor, width: int) -> None:
    if x.dtype != torch.float32 or x.shape[-1] != width or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"{name}: [..., {width}] contiguous float32 on the CPU, got {x.dtype} {tuple(x.shape)}")


class DecoderKernels:
    """A whole decode step of the fast preset's block-wise decoder layers in one call (``bind``,
    what ``model.Qwen2LM.use_decoder_kernels`` runs), and the two operations it computes in the
    kernels' own arithmetic (``csrc/kernels.h``: the same bits on the ``avx512_vnni`` and ``avx2``
    paths), callable alone for their tests and benchmarks: the RMSNorm and the SiLU-gated product,
    within a few float32 ulps of PyTorch's ``rms_norm`` and ``silu(gate) * up`` (whose bits depend
    on the vector width PyTorch's build runs).
    """

    def __init__(self, module: ModuleType, path: str) -> None:
        self._module, self.path, self._path_id = module, path, _PATH_ID[path]

    def __reduce__(self) -> tuple:  # a copy or a pickle loads the kernels of its path again
        return decoder_kernels, (self.path,)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` ``[..., n]`` contiguous float32, ``weight`` ``[n]`` float32 -> ``[..., n]`` float32:
        ``(x * 1 / sqrt(mean(x^2) + eps)) * weight``, the mean summed as ``csrc/kernels.h`` says.

        Raises:
            ValueError: a dtype, shape, layout or device the kernel cannot read.
        """
        n = weight.shape[-1]
        _check_float_rows("x", x, n)
        _check_float_rows("weight", weight, n)
        if weight.dim() != 1:
            raise ValueError(f"weight: [{n}], got {tuple(weight.shape)}")
        y = torch.empty(x.shape, dtype=torch.float32)
        self._module.rms_norm(torch.get_num_threads(), x.data_ptr(), x.numel() // n, n, weight.data_ptr(), eps,
                              y.data_ptr())  # fmt: skip
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` ``[..., 2 n]`` contiguous float32 (the gate's ``n`` values, then the up
        values'; ``FeedForward.w_gate_up``'s output) -> ``silu(gate) * up`` ``[..., n]`` float32.

        Raises:
            ValueError: a dtype, an odd last dimension, a layout or device the kernel cannot read.
        """
        width = gate_up.shape[-1]
        if width % 2 or width == 0:
            raise ValueError(f"gate_up: an even last dimension, got {tuple(gate_up.shape)}")
        _check_float_rows("gate_up", gate_up, width)
        y = torch.empty(*gate_up.shape[:-1], width // 2, dtype=torch.float32)
        self._module.silu_mul(self._path_id, torch.get_num_threads(), gate_up.data_ptr(), gate_up.numel() // width,
                              width // 2, y.data_ptr())  # fmt: skip
        return y

    def bind(self, layers: list[DecoderLayerRefs], heads: int, intermediate: int, eps: float) -> BoundDecoder:
        """A decode step through ``layers`` in one call (``BoundDecoder``), their tensors checked now:
        ``heads`` query heads, ``intermediate`` the feed-forward's width, ``eps`` the norms'.

        Raises:
            ValueError: a tensor the kernels cannot read, or sizes that disagree between layers.
        """
        return BoundDecoder(self._module, self._path_id, layers, heads, intermediate, eps)


# Where one decoder layer's tensors live, in the order of csrc/kernels.h's DecoderLayerWeights: the
# attention norm's weight; wqkv's packed weight, scale and bias; wo's three; the feed-forward norm's
# weight; w_gate_up's three; w_down's three; the KV cache's keys and values. Each is (the dict that
# holds it, its key): a module's ``_parameters`` or ``_buffers``, so a tensor replaced there (``to``,
# an assignment) is seen at the next call.
DecoderLayerRefs = list[tuple[dict[str, Any], str]]
_LAYER_FIELDS = 16  # entries of a DecoderLayerRefs
_LINEARS = (1, 4, 8, 11)  # positions of the four linears' packed weights in DecoderLayerRefs


class BoundDecoder:
    """A decode step through every decoder layer in one call (``csrc/module.cpp``'s
    ``decode_layers``): per layer ``h += wo(attention(wqkv(norm(h))))`` and
    ``h += w_down(silu_mul(w_gate_up(norm(h))))`` with the block kernel, the decode attention and
    ``DecoderKernels``' RMSNorm and SiLU-gated product: the same bits as those calls one by one.

    Holds the layers' tensors; each call compares them (identity and data pointer) with the ones
    in the ``_parameters`` and ``_buffers`` it was bound through, and checks and binds again before
    the kernels read a replaced or moved one (a replaced module is its caller's to see:
    ``model.Qwen2LM`` binds again). Not for two threads at once: the call releases the GIL.

    Raises:
        ValueError: (when bound, or from a call that binds again) a tensor the kernels cannot read.
    """

    def __init__(
        self,
        module: ModuleType,
        path_id: int,
        layers: list[DecoderLayerRefs],
        heads: int,
        intermediate: int,
        eps: float,
    ) -> None:
        self._module, self._path_id, self._heads, self._eps = module, path_id, heads, eps
        self._intermediate = intermediate
        if not layers or any(len(layer) != _LAYER_FIELDS for layer in layers):
            raise ValueError(f"layers: at least one, each {_LAYER_FIELDS} (holder, key) pairs (DecoderLayerRefs)")
        self._owners = [owner for layer in layers for owner, _ in layer]
        self._keys = [key for layer in layers for _, key in layer]
        self._layers = len(layers)
        self._bind()

    def _bind(self) -> None:
        tensors = list(map(operator.getitem, self._owners, self._keys))
        fields = _LAYER_FIELDS
        k_cache = tensors[fields - 2]
        if k_cache.dtype != torch.float32 or k_cache.dim() != 4 or not k_cache.is_contiguous():
            raise ValueError(f"KV cache: [slots, kv_heads, max_len, d] contiguous float32, got {k_cache.dtype}")
        slots, kv_heads, max_len, d = k_cache.shape
        hidden = tensors[0].shape[0]
        qkv_n, intermediate = (self._heads + 2 * kv_heads) * d, self._intermediate
        plan = []
        for layer in range(self._layers):
            t = tensors[layer * fields : (layer + 1) * fields]
            attention_norm, ffn_norm, k, v = t[0], t[7], t[14], t[15]
            for name, norm in (("attention norm", attention_norm), ("feed-forward norm", ffn_norm)):
                if norm.dtype != torch.float32 or tuple(norm.shape) != (hidden,) or not norm.is_contiguous():
                    raise ValueError(f"layer {layer} {name}: [{hidden}] contiguous float32")
            for name, cache in (("keys", k), ("values", v)):
                if cache.dtype != torch.float32 or cache.shape != k_cache.shape or not cache.is_contiguous():
                    raise ValueError(f"layer {layer} {name}: {list(k_cache.shape)} contiguous float32")
            sizes = ((qkv_n, hidden), (hidden, self._heads * d), (2 * intermediate, hidden), (hidden, intermediate))
            row = [attention_norm.data_ptr()]
            for at, (n, k_size) in zip(_LINEARS, sizes, strict=True):
                weight, scale, bias = t[at : at + 3]
                check_block_weight(weight, scale, bias, n)
                k_pad = weight.shape[1] * 4
                if not k_pad - 32 < k_size <= k_pad:
                    raise ValueError(f"layer {layer}: a weight {tuple(weight.shape)} for {k_size} inputs")
                row += [weight.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(), weight.shape[0],
                        k_pad]  # fmt: skip
                if at == 4:
                    row.append(ffn_norm.data_ptr())
            plan.append(row + [k.data_ptr(), v.data_ptr()])
        self._plan = torch.tensor(plan, dtype=torch.int64)
        self._sizes = (hidden, self._heads, kv_heads, d, intermediate)
        self._cache = (slots, max_len)
        self._tensors = tensors
        self._held = [t for t in tensors if t is not None]
        self._pointers = [t.data_ptr() for t in self._held]
        # the storages the pointers point into, held: no other tensor takes their addresses while
        # bound; a storage moved in place (share_memory_) is caught by the pointer comparison of
        # the next call. One thread at a time: the call releases the GIL for the whole step.
        self._storages = [t.untyped_storage() for t in self._held]

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, row_slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """One decode step: ``h`` ``[B, hidden]`` float32 contiguous, the rows' embeddings, becomes
        the last layer's output in place; ``cos``, ``sin`` ``[B, d]`` (``model.MRoPE``'s), ``row_slots``
        and ``positions`` ``[B]`` int64 as for the decode attention (``_decode_attention``).

        Raises:
            ValueError: a dtype, shape or layout the kernels cannot read, a row outside the KV
                cache, or a replaced tensor they cannot read.
        """
        now = map(operator.getitem, self._owners, self._keys)  # loops in C: ~30 us for MinerU2.5's 384 tensors
        if (
            not all(map(operator.is_, now, self._tensors))
            or list(map(torch.Tensor.data_ptr, self._held)) != self._pointers
        ):
            self._bind()
        hidden, heads, kv_heads, d, intermediate = self._sizes
        batch = h.shape[0]
        for name, t, dtype, shape in (
            ("h", h, torch.float32, (batch, hidden)),
            ("cos", cos, torch.float32, (batch, d)),
            ("sin", sin, torch.float32, (batch, d)),
            ("row_slots", row_slots, torch.int64, (batch,)),
            ("positions", positions, torch.int64, (batch,)),
        ):
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"{name}: {list(shape)} contiguous {dtype} on the CPU, got {t.dtype} {tuple(t.shape)}")
        slots, max_len = self._cache
        self._module.decode_layers(self._path_id, torch.get_num_threads(), self._plan.data_ptr(), self._layers,
                                   h.data_ptr(), batch, hidden, heads, kv_heads, d, intermediate, self._eps,
                                   cos.data_ptr(), sin.data_ptr(), slots, max_len, row_slots.data_ptr(),
                                   positions.data_ptr(), d**-0.5)  # fmt: skip


def check_gemv_weight(
    weight: torch.Tensor, weight_sum: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Check a GEMV layer's tensors (``[N, K]`` int8, ``[N]`` int32, ``[N]`` float32, ``[N]`` float32
    or None, all contiguous) before the kernel ever reads them.

    Raises:
        ValueError: a dtype, a shape or a memory layout the kernel cannot read.
    """
    if weight.dtype != torch.int8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight: [N, K] contiguous int8, got {weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    for name, tensor, dtype in (("weight_sum", weight_sum, torch.int32), ("weight_scale", weight_scale, torch.float32)):
        if tensor.dtype != dtype or tuple(tensor.shape) != (n,) or not tensor.is_contiguous():
            raise ValueError(f"{name}: [{n}] contiguous {dtype}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias: [{n}] contiguous float32")


@functools.cache
def kernel_status() -> KernelStatus:
    """Load the kernels and choose their path, or say why they are not used (cached per process).

    Never raises: an extension that is missing, stale or does not load gives a status without
    kernels (logged once); the block-wise layers then run the same arithmetic in PyTorch.
    """
    if _disabled():
        reason = f"own kernels off ({OWN_KERNELS_ENV}=0): block-wise INT8 in PyTorch (the same arithmetic, slow)"
        return KernelStatus(None, reason, gemv_reason=f"own INT8 GEMV off ({OWN_KERNELS_ENV}=0): oneDNN")
    try:
        paths = allowed_paths()
        module = _load_module()
    except (ImportError, OSError, ValueError) as exc:
        reason = (
            f"own kernels not loaded ({type(exc).__name__}: {exc}): "
            "block-wise INT8 in PyTorch (the same arithmetic, slow)"
        )
        logger.warning("%s", reason)
        return KernelStatus(None, reason, gemv_reason=f"own INT8 GEMV not loaded ({type(exc).__name__}): oneDNN")
    runnable = [p for p in paths if p in module.cpu_paths()]
    path = runnable[0] if runnable else "portable"
    best = module.cpu_paths()[0]
    lowered = "" if path == best else f" (this CPU could run {best}: lowered by its ISA class's caps or {PATH_ENV})"
    gemv = _gemv_linear(module) if path == "avx512_vnni" else None
    rows = (
        f"own AVX-512 VNNI INT8 GEMV for 1-{MAX_ROWS} rows, torch._int_mm above"
        if gemv
        else f"the own INT8 GEMV needs the avx512_vnni path ({path} here): oneDNN"
    )
    reason = f"own block-wise INT8 kernel, {path} path{lowered}"
    decode = _decode_attention(module, path) if path in DECODE_ATTENTION_PATHS else None
    decoder = DecoderKernels(module, path) if path in DECODE_ATTENTION_PATHS else None
    quantize = _quantize_tokens(module) if path in DECODE_ATTENTION_PATHS else None
    return KernelStatus(path, reason, _block_linear(module, path), gemv, rows, decode, decoder, quantize)


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
NO_BF16_ATTENTION = "no AVX-512 BF16 in this CPU class: float32 attention (PyTorch SDPA)"


@dataclass(frozen=True)
class AttentionStatus:
    """Whether an attention other than PyTorch's float32 SDPA runs the vision encoder's here (the own
    bfloat16 or float32 kernel, or bfloat16 SDPA), and why not when none does.

    Attributes:
        attention: ``attention(q, k, v, out)``: ``q``, ``k``, ``v`` ``[heads, n, d]`` float32 with
            contiguous rows of ``d`` (``d`` a multiple of 16, 16 to 128), ``out`` a float32 ``[n, >= heads * d]``
            view whose rows are ``heads * d`` (or more) apart and whose last dimension is
            contiguous; writes head ``h``'s outputs to ``out[:, h * d : (h + 1) * d]``. The
            arithmetic is ``csrc/kernels.h``'s bfloat16 or float32 attention (``reason`` says
            which), or ``sdpa_bf16_attention``'s; the scale is ``d ** -0.5``. None where none runs.
        reason: one line: what runs the vision attention, for ``engine.numerics``.
    """

    attention: Attention | None
    reason: str


def _attention(run: Callable[..., None]) -> Attention:
    """``AttentionStatus.attention`` over ``run``, the module's ``attention_bf16`` or ``attention_f32``
    (the same arguments): the tensors' dtypes, shapes and strides checked (``ValueError``), the
    sizes by the module (``ValueError``), PyTorch's thread count. ``q``, ``k`` and ``v`` may be views
    (the vision encoder's rotary outputs and its qkv projection's columns): the kernels read them
    by their head and row strides."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        heads, n, d = q.shape
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.shape != q.shape or t.stride(2) != 1:
                raise ValueError(
                    f"{name}: [heads, n, d] float32 like q, rows of d contiguous, got {t.dtype} {tuple(t.shape)} "
                    f"strides {t.stride()}"
                )
        if out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != n or out.shape[1] < heads * d:
            raise ValueError(f"out: [{n}, >= {heads * d}] float32, got {out.dtype} {tuple(out.shape)}")
        if out.stride(1) != 1 or out.stride(0) < heads * d:
            raise ValueError(f"out: contiguous rows at least {heads * d} apart, got strides {out.stride()}")
        run(
            torch.get_num_threads(),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            *(t.stride(0) for t in (q, k, v)),
            *(t.stride(1) for t in (q, k, v)),
            heads,
            n,
            d,
            d**-0.5,
            out.data_ptr(),
            out.stride(0),
        )

    return attention


@functools.cache
def attention_status() -> AttentionStatus:
    """The own bfloat16 attention where this CPU class has AVX-512 BF16 (caps included) and the
    extension loads, else why not (cached per process; never raises: the vision encoder then runs
    PyTorch's float32 attention)."""
    if _disabled():
        return AttentionStatus(None, f"own kernels off ({OWN_KERNELS_ENV}=0): float32 attention (PyTorch SDPA)")
    if not isa_class(read_topology().isa).native_bf16:
        return AttentionStatus(None, NO_BF16_ATTENTION)
    try:
        module = _load_module()
    except (ImportError, OSError) as exc:
        return AttentionStatus(None, f"own kernels not loaded ({type(exc).__name__}): float32 attention (PyTorch SDPA)")
    if not module.attention_runs():
        return AttentionStatus(None, "the CPU lacks AVX-512 BF16: float32 attention (PyTorch SDPA)")
    return AttentionStatus(_attention(module.attention_bf16), "own bfloat16 attention (AVX-512 BF16), float32 softmax")


F32_ATTENTION = "own float32 attention (AVX2)"


@functools.cache
def f32_attention_status() -> AttentionStatus:
    """The own float32 attention (``csrc/kernels.h``'s float32 attention, AVX2 + FMA) where the CPU
    class is ``avx2`` (caps included) and the kernels' path is ``avx2``, else why not (cached per
    process; never raises). On the AVX-512 classes without BF16 PyTorch's float32 SDPA, on its
    AVX-512 build, is the faster, so it runs there (a layout image's attention natively on an AMX
    Xeon, 2 threads: SDPA at 1.6x the kernel's speed; ``benchmarks/vision_attention.py``,
    results/2026-12-06d-xeon-amx-2core-avx2/vision_attention_native.json)."""
    if isa_class(read_topology().isa).name != "avx2":
        return AttentionStatus(None, "float32 attention (PyTorch SDPA): the own float32 one is for the avx2 class")
    status = kernel_status()
    if status.block is None:
        return AttentionStatus(None, f"float32 attention (PyTorch SDPA): {status.reason}")
    if status.path != "avx2":
        return AttentionStatus(None, f32_attention_path_reason(str(status.path)))
    return AttentionStatus(f32_attention_kernel(), F32_ATTENTION)


def f32_attention_path_reason(path: str) -> str:
    """Why the avx2 class runs float32 SDPA where the kernels run another path (``path``, lowered by
    ``MINERU_FAST_KERNEL_PATH``, or a CPU without FMA), one line."""
    return f"float32 attention (PyTorch SDPA): the own float32 attention needs the kernels' avx2 path ({path} here)"


def f32_attention_kernel() -> Attention:
    """The own float32 attention (``AttentionStatus.attention``'s contract; the arithmetic:
    ``csrc/kernels.h``'s float32 attention), whatever the CPU class would choose (tests run it on
    every CPU with AVX2; ``vision_attention_status()`` is what the engine runs).

    Raises:
        ImportError: the extension is not built (or stale).
        ValueError: this CPU lacks AVX2 and FMA.
    """
    return _attention(_decode_path_module("avx2", "float32 attention").attention_f32)


AMX_ATTENTION = "PyTorch SDPA in bfloat16 (its flash attention on AMX tiles), float32 softmax"


def sdpa_bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """``AttentionStatus.attention``'s contract (``q``, ``k``, ``v`` ``[heads, n, d]`` float32, head
    ``h``'s outputs to ``out[:, h * d : (h + 1) * d]``) on PyTorch's SDPA over bfloat16 copies of
    ``q``, ``k`` and ``v``: its CPU flash attention, whose bfloat16 GEMMs run on AMX tiles where the
    CPU has them, scores and softmax in float32, probabilities rounded to bfloat16 for the values'
    GEMM; the scale is ``d ** -0.5``. Raises what SDPA raises on a shape it cannot take."""
    heads, n, d = q.shape
    # contiguous copies whatever the inputs' strides (the encoder passes views): the layout SDPA was
    # measured on
    qb, kb, vb = (t.to(torch.bfloat16, memory_format=torch.contiguous_format) for t in (q, k, v))
    attended = torch.nn.functional.scaled_dot_product_attention(qb[None], kb[None], vb[None])[0]  # [heads, n, d]
    out[:, : heads * d].unflatten(1, (heads, d)).copy_(attended.transpose(0, 1))


@functools.cache
def vision_attention_status() -> AttentionStatus:
    """What the fast preset's vision attention runs on this CPU class (cached per process; never
    raises): on the AMX class (caps included), ``sdpa_bf16_attention``, since the own kernel's
    AVX-512 BF16 dot products are slower there than AMX tiles (a 5,476-patch layout image, 16 heads,
    2 threads, an AMX Xeon, 2026-12-06: 141 GFLOP/s own, 573 PyTorch's bfloat16 SDPA, 234 its float32;
    ``benchmarks/vision_attention.py``, results/2026-12-06-xeon-amx-2core); elsewhere
    ``attention_status()``'s choice. ``MINERU_FAST_OWN_KERNELS=0`` does not turn the AMX choice
    off: it is PyTorch's operator, not an own kernel (``vision_attention="fp32"`` does)."""
    name = isa_class(read_topology().isa).name
    if name == "amx":
        return AttentionStatus(sdpa_bf16_attention, AMX_ATTENTION)
    if name == "avx2":
        return f32_attention_status()
    return attention_status()
