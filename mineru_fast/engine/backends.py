"""Backends of the fast engine: stock PyTorch, or Intel Extension for PyTorch (IPEX) on top of it.

IPEX is optional (``pip install 'mineru-fast[ipex]'``): its last release, 2.8, pins torch 2.8.*
and Intel has stopped its active development. It is detected from package metadata without
importing it (an IPEX built for another torch ends the process when imported), and used only when
its major.minor version equals torch's. Under ``backend="ipex"`` the engine gets:

- ``ipex.optimize`` on the vision encoder and the language model (oneDNN weight prepacking of the
  float linears, in the engine's dtype);
- IPEX's INT8 linear (weight-only INT8 with INT8 compute, ``WoqLowpMode.INT8``) instead of
  torch.ao's dynamic INT8 only where the measurement table says it is faster on this CPU;
- the vision encoder in the options' ``vision_mode``; ``"trace"`` lets IPEX's TorchScript fusions
  apply, at the price of a trace per image grid (every crop size), so it is not forced.

``backend="auto"`` reads ``assets/backend_measurements.json``: entries recorded per CPU vendor and
ISA tier (``isa_tier``), with seconds per page of the stock and IPEX backends (from ``mineru-fast
bench``) and milliseconds of one INT8 linear (``benchmarks/backend_int8.py``). IPEX is chosen only
when an entry for this CPU shows it faster and it is usable; otherwise stock.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types
from dataclasses import dataclass

from mineru_fast.options import BACKENDS
from mineru_fast.runtime.choice import load_measurements
from mineru_fast.runtime.cpu import Topology, isa_class, read_topology

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'mineru-fast[ipex]' (torch 2.8 + intel-extension-for-pytorch 2.8)"


@dataclass(frozen=True)
class BackendStatus:
    """Whether IPEX can be used here: ``version`` when installed, ``reason`` when not usable."""

    usable: bool
    version: str | None
    reason: str


@dataclass(frozen=True)
class BackendChoice:
    """The backend an engine gets: ``backend`` and ``int8`` are ``"stock"`` or ``"ipex"``."""

    backend: str
    int8: str
    reason: str


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def ipex_status() -> BackendStatus:
    """Installed IPEX version and whether it matches the installed torch (read from package
    metadata; nothing is imported)."""
    try:
        version = importlib.metadata.version("intel-extension-for-pytorch")
    except importlib.metadata.PackageNotFoundError:
        return BackendStatus(False, None, f"not installed: {INSTALL_HINT}")
    torch_version = importlib.metadata.version("torch")
    if _major_minor(version) != _major_minor(torch_version):
        wanted = ".".join(map(str, _major_minor(version)))
        return BackendStatus(False, version, f"IPEX {version} needs torch {wanted}.*, found torch {torch_version}")
    return BackendStatus(True, version, "")


def isa_tier(topology: Topology) -> str:
    """The ISA class the kernels run at (``cpu.isa_class``: ``amx``, ``avx512_bf16``,
    ``avx512_vnni``, ``avx512``, ``avx2`` or ``baseline``, lowered by simulation caps), the key of
    the measurement table."""
    return isa_class(topology.isa).name


def _faster(figures: dict | None) -> str:
    """``"ipex"`` when both figures are recorded and IPEX's is smaller, else ``"stock"``."""
    if not figures or figures.get("stock") is None or figures.get("ipex") is None:
        return "stock"
    return "ipex" if figures["ipex"] < figures["stock"] else "stock"


def choose_backend(
    requested: str,
    topology: Topology | None = None,
    status: BackendStatus | None = None,
    measurements: list[dict] | None = None,
) -> BackendChoice:
    """Resolve ``"stock"``, ``"ipex"`` or ``"auto"`` to the backend the engine will use.

    ``"ipex"`` without a usable IPEX logs a warning saying why and what to install, and gives
    stock. ``"auto"`` follows the measurement entry of this CPU's vendor and ISA tier.

    Raises:
        ValueError: unknown ``requested``.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "stock":
        return BackendChoice("stock", "stock", "requested")
    status = status or ipex_status()
    topology = topology or read_topology()
    entries = load_measurements() if measurements is None else measurements
    entry = next((e for e in entries if (e["vendor"], e["isa_tier"]) == (topology.vendor, isa_tier(topology))), None)
    int8 = _faster(entry and entry.get("int8_linear_ms"))
    if requested == "ipex":
        if not status.usable:
            logger.warning("IPEX backend unavailable (%s); using the stock backend", status.reason)
            return BackendChoice("stock", "stock", f"ipex requested but {status.reason}")
        return BackendChoice("ipex", int8, "requested")
    if entry is None:
        return BackendChoice("stock", "stock", f"auto: no measurement for {topology.vendor} {isa_tier(topology)}")
    if _faster(entry.get("page_s")) == "ipex":
        if status.usable:
            return BackendChoice("ipex", int8, f"auto: measured faster on {entry['cpu']}")
        return BackendChoice("stock", "stock", f"auto: IPEX measured faster on {entry['cpu']} but {status.reason}")
    page_s = entry.get("page_s") or {}
    if page_s.get("stock") is None or page_s.get("ipex") is None:
        return BackendChoice("stock", "stock", f"auto: stock vs IPEX pages not yet measured on {entry['cpu']}")
    return BackendChoice("stock", "stock", f"auto: stock measured faster on {entry['cpu']}")


def _transformers_shim() -> None:
    """IPEX 2.8 imports ``transformers.modeling_attn_mask_utils`` (removed in transformers 5) for its
    LLM paths, which this package does not use; register an empty stand-in so IPEX imports."""
    name = "transformers.modeling_attn_mask_utils"
    try:
        importlib.import_module(name)
    except ImportError:
        shim = types.ModuleType(name, "Stand-in: IPEX's LLM module paths are not used by mineru-fast.")
        shim._prepare_4d_causal_attention_mask = shim._prepare_4d_attention_mask = None  # type: ignore[attr-defined]
        shim.AttentionMaskConverter = None  # type: ignore[attr-defined]
        sys.modules[name] = shim


def load_ipex() -> types.ModuleType:
    """Import ``intel_extension_for_pytorch``.

    Raises:
        ImportError: IPEX is missing or does not match torch (the message says why).
    """
    status = ipex_status()
    if not status.usable:
        raise ImportError(status.reason)
    _transformers_shim()
    import intel_extension_for_pytorch as ipex

    return ipex


def ipex_int8_linear(linear):
    """IPEX's INT8 linear for ``linear``: int8 weights, activations quantized to int8 at run time
    (call after ``load_ipex``)."""
    from intel_extension_for_pytorch.nn.modules import WeightOnlyQuantizedLinear
    from intel_extension_for_pytorch.quantization import (
        WoqLowpMode,
        WoqWeightDtype,
        get_weight_only_quant_qconfig_mapping,
    )

    mapping = get_weight_only_quant_qconfig_mapping(weight_dtype=WoqWeightDtype.INT8, lowp_mode=WoqLowpMode.INT8)
    linear.qconfig = mapping.global_qconfig
    return WeightOnlyQuantizedLinear.from_float(linear)


def _swap_int8(module, select) -> None:
    from torch import nn

    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and select(n)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, ipex_int8_linear(getattr(parent, child).float()))


def apply_ipex(engine, int8_parts: dict[str, bool], use_ipex_int8: bool) -> None:
    """Put a built ``FastEngine`` on IPEX, in place.

    Args:
        engine: the fast engine, built with float linears wherever ``use_ipex_int8`` will quantize.
        int8_parts: which parts the options quantize to dynamic INT8: keys ``"vision"``,
            ``"lm"``, ``"lm_head"``.
        use_ipex_int8: quantize those parts with IPEX's INT8 linear (the engine then holds them
            in float); when False they already hold the stock INT8 layers.

    Raises:
        ImportError: IPEX cannot be imported.
    """
    from mineru_fast.engine.vision_runner import make_vision_runner

    ipex = load_ipex()
    if use_ipex_int8:
        if int8_parts["vision"]:
            _swap_int8(engine.vision, lambda _: True)
        _swap_int8(engine.lm, lambda n: int8_parts["lm_head"] if n == "lm_head" else int8_parts["lm"])
    for name in ("vision", "lm"):
        module = getattr(engine, name).eval()
        # No batch norms to fold: skip the fx passes that would try (and fail) to trace these modules.
        optimized = ipex.optimize(module, dtype=engine.dtype, inplace=True, weights_prepack=True,
                                  conv_bn_folding=False, linear_bn_folding=False)  # fmt: skip
        setattr(engine, name, optimized)
    engine.vision_runner = make_vision_runner(engine.vision, engine.vision_mode)
    logger.info("IPEX %s applied (INT8 by %s)", ipex.__version__, "IPEX" if use_ipex_int8 else "torch.ao")
