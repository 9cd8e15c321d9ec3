"""What an engine built from ``ParserOptions`` runs on this machine, and why.

``describe(options)`` is the ``numerics`` block of result metadata and ``mineru-fast info``: the ISA
class (``runtime.cpu.isa_class``, with the caps that lowered it), the precision and whether
bfloat16 is native or emulated there, and the INT8 kernel the options resolve to
(``runtime.choice.choose_int8_kernel``) with its exact numerics (``quantize.int8_kernel_path``).
"""

from __future__ import annotations

import logging

from mineru_fast.engine.quantize import int8_kernel_path
from mineru_fast.options import ParserOptions
from mineru_fast.runtime.choice import choose_int8_kernel
from mineru_fast.runtime.cpu import Topology, isa_class, read_topology

logger = logging.getLogger(__name__)


def describe(options: ParserOptions, topology: Topology | None = None, environ: dict[str, str] | None = None) -> dict:
    """What an engine built from ``options`` runs on this machine, and why (JSON-ready): ISA class
    (and the caps that lowered it), precision and whether bfloat16 is native or emulated, the
    per-token INT8 kernel of the ``int8-dynamic`` layers with its exact numerics
    (``quantize.int8_kernel_path``; imports torch) and the reason (None where no layer is
    ``int8-dynamic``)."""
    topology = topology or read_topology()
    cls = isa_class(topology.isa, environ)
    # The per-token INT8 kernel serves the int8-dynamic layers only: int8-block layers run the block
    # kernel (or its PyTorch form) on every machine, reported as lm_int8_block by engine.factory.
    quants = (options.vision_quant, options.lm_quant, options.lm_head_quant)
    per_token = "int8-dynamic" in quants
    kernel = choose_int8_kernel(options.int8_kernel, topology, environ=environ) if per_token else None
    bf16 = options.precision == "bf16"
    return {
        "isa_class": cls.name,
        "hardware_isa_class": cls.hardware,
        "isa_capped_by": cls.capped_by,
        "engine": options.engine,
        "precision": options.precision,
        "bf16": ("native" if cls.native_bf16 else "emulated") if bf16 else None,
        "int8_kernel": kernel.value if kernel else None,
        "int8_kernel_path": int8_kernel_path(kernel.value) if kernel else None,
        "int8_reason": kernel.reason if kernel else None,
    }


def warn_if_emulated_bf16(options: ParserOptions, topology: Topology | None = None) -> bool:
    """Log a warning when ``options`` compute in bfloat16 on a class without native bfloat16.

    Returns:
        Whether it warned.
    """
    cls = isa_class((topology or read_topology()).isa)
    if options.precision != "bf16" or cls.native_bf16:
        return False
    logger.warning(
        "precision bf16 on an %s CPU class without native bfloat16: PyTorch emulates it, several "
        "times slower than float32 (use the fast, auto or reference-fp32 preset)",
        cls.name,
    )
    return True
