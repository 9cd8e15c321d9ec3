"""``mineru-fast info``: what the runtime sees and would choose on this machine."""

from __future__ import annotations

import importlib.metadata
import os

from mineru_fast.engine.backends import choose_backend, ipex_status
from mineru_fast.protocol.spec import DEFAULT_MODEL_VERSION
from mineru_fast.runtime.choice import CANDIDATES, choose_int8_kernel, choose_preset
from mineru_fast.runtime.cpu import Topology, format_cpulist, isa_class, read_topology
from mineru_fast.runtime.hub import DEFAULT_MODEL_ID, MODEL_IDS, prepared_cache_root
from mineru_fast.runtime.threads import plan_threads


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def prepared_cache_summary() -> dict:
    """Where the prepared-model cache is (``hub.prepared_cache_root``; None when turned off) and
    what it holds: committed entries, their bytes on disk."""
    root = prepared_cache_root()
    manifests = sorted(root.glob("*/manifest.json")) if root is not None and root.is_dir() else []
    size = sum(f.stat().st_size for m in manifests for f in m.parent.iterdir() if f.is_file())
    return {"root": str(root) if root is not None else None, "entries": len(manifests), "bytes": size}


def collect(topology: Topology | None = None) -> dict:
    """Topology, ISA, allowed CPUs, the thread plan a ``parse`` process would get, installed
    backends with versions, what ``backend="auto"`` would choose, and the model ``parse`` loads
    without ``--model`` with the protocol version it runs (JSON-ready). Imports no torch."""
    topology = topology or read_topology()
    plan = plan_threads(topology)
    ipex = ipex_status()
    auto = choose_backend("auto", topology, ipex)
    cls = isa_class(topology.isa)
    preset, kernel = choose_preset(topology), choose_int8_kernel("auto", topology)
    return {
        "cpu": {
            "model": topology.model,
            "vendor": topology.vendor,
            "isa_tier": cls.name,
            "hardware_isa_tier": cls.hardware,
            "isa_capped_by": cls.capped_by,
            "native_bf16": cls.native_bf16,
            "vnni": cls.vnni,
        },
        "isa": topology.isa,
        "topology": {
            "sockets": topology.socket_count,
            "physical_cores": len(topology.cores),
            "logical_cpus": sum(len(core) for core in topology.cores),
            "numa_nodes": [
                {"id": n.id, "cpus": format_cpulist(n.cpus), "memory_gb": n.memory_kb and round(n.memory_kb / 1e6, 1)}
                for n in topology.nodes
            ],
        },
        "allowed": {
            "cpus": format_cpulist(topology.allowed),
            "physical_cores": len(topology.allowed_cores()),
            "cgroup_quota_cpus": topology.quota_cpus,
            "usable_cores": topology.usable_cores,
        },
        "threads": {
            "intra_op": plan.intra_op,
            "inter_op": plan.inter_op,
            "openmp": plan.openmp,
            "sets": plan.env,
            "kept_user_set": plan.kept,
            "environment": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "MKL_"))},
        },
        "backends": {
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "ipex": {"version": ipex.version, "usable": ipex.usable, "reason": ipex.reason or None},
            "auto_chooses": {"backend": auto.backend, "int8": auto.int8, "reason": auto.reason},
        },
        "choices": {
            "auto_preset": {
                "candidate": preset.value,
                "preset": CANDIDATES[preset.value][0],
                "overrides": CANDIDATES[preset.value][1],
                "reason": preset.reason,
            },
            "int8_kernel_auto": {"kernel": kernel.value, "reason": kernel.reason},
            "lm_quant_fast": _fast_lm_quant(topology),
            "vision_attention_fast": _fast_vision_attention(topology),
            "vision_linears_fast": _fast_vision_linears(topology),
        },
        "prepared_cache": prepared_cache_summary(),
        "model": {"default": DEFAULT_MODEL_ID, "protocol_version": DEFAULT_MODEL_VERSION, "versions": MODEL_IDS},
        # MinerU 4's renderer (the mineru4 extra): HTML, LaTeX, DOCX, EPUB, PDF from the bundle
        "renderer": {"docvortex": _version("docvortex")},
    }


def _kernel_path(topology: Topology) -> str:
    """The own kernels' instruction-set path on ``topology``'s CPU class: the fastest one its class
    (and ``MINERU_FAST_KERNEL_PATH``) allows, else ``"portable"`` (every path is in the installed
    module, so this is the path ``kernels.kernel_status`` takes on such a CPU)."""
    from mineru_fast.engine.kernels import allowed_paths

    return (allowed_paths(topology) or ("portable",))[0]


def _fast_lm_quant(topology: Topology) -> dict[str, str]:
    """What runs the fast preset's ``lm_quant="int8-block"`` on ``topology``: the own kernel's
    instruction-set path its CPU class allows (every path is in the installed module, with the same
    arithmetic), or, where this install cannot load the module or it is turned off, why its PyTorch
    form runs; and what runs its decode attention (``decode_attention``: the own kernel's path, or
    ``"pytorch"``)."""
    from mineru_fast.engine.kernels import DECODE_ATTENTION_PATHS, kernel_status

    status = kernel_status()
    if status.block is None:
        return {"quant": "int8-block", "path": "pytorch", "reason": status.reason, "decode_attention": "pytorch"}
    path = _kernel_path(topology)
    own_attention = path in DECODE_ATTENTION_PATHS
    return {
        "quant": "int8-block",
        "path": path,
        "reason": f"32-value INT8 scales on the own kernel's {path} path (the same arithmetic on every path); "
        + (
            f"decode attention on the own kernel's {path} path"
            if own_attention
            else "decode attention on PyTorch's operators (no own one on the portable path)"
        ),
        "decode_attention": path if own_attention else "pytorch",
    }


def _fast_vision_attention(topology: Topology) -> dict[str, str]:
    """What runs the fast preset's vision attention (``vision_attention="bf16"``) on ``topology``:
    PyTorch's bfloat16 SDPA on the AMX class, the own bfloat16 kernel where its CPU class has
    AVX-512 BF16 and this install loads it, the own float32 kernel on the AVX2 class where this
    install loads the kernels, else PyTorch's float32 SDPA, with the reason."""
    from mineru_fast.engine.kernels import (
        F32_ATTENTION,
        NO_BF16_ATTENTION,
        f32_attention_path_reason,
        kernel_status,
        vision_attention_status,
    )

    cls = isa_class(topology.isa)
    if cls.name == "avx2":
        kernels = kernel_status()
        if kernels.block is None:
            return {"attention": "fp32", "reason": f"float32 attention (PyTorch SDPA): {kernels.reason}"}
        path = _kernel_path(topology)
        if path != "avx2":
            return {"attention": "fp32", "reason": f32_attention_path_reason(path)}
        return {"attention": "fp32", "reason": F32_ATTENTION}
    if not cls.native_bf16:
        return {"attention": "fp32", "reason": NO_BF16_ATTENTION}
    status = vision_attention_status()
    return {"attention": "bf16" if status.attention else "fp32", "reason": status.reason}


def _fast_vision_linears(topology: Topology) -> dict[str, str]:
    """What runs the GEMM of the fast preset's vision linears (``int8-dynamic`` on ``onednn``) on
    ``topology``: the own AVX2 GEMM on the avx2 class where this install runs the kernels' avx2
    path, else oneDNN's, with the reason (``kernels.per_channel_gemm_reason``, as the engine decides)."""
    from mineru_fast.engine.kernels import OWN_GEMM, kernel_status, per_channel_gemm_reason

    status = kernel_status()
    path = _kernel_path(topology) if status.block is not None else None
    reason = per_channel_gemm_reason(isa_class(topology.isa).name, status, path)
    return {"gemm": "own_avx2" if reason == OWN_GEMM else "onednn", "reason": reason}


def render(info: dict) -> str:
    """``collect()``'s dict as the human-readable report."""
    t, a, th, b = info["topology"], info["allowed"], info["threads"], info["backends"]
    isa = ", ".join(flag for flag, present in info["isa"].items() if present) or "none of the tracked flags"
    amx = "yes" if any(info["isa"][f] for f in ("amx_tile", "amx_bf16", "amx_int8")) else "no"
    ipex = b["ipex"]
    ipex_line = (
        f"{ipex['version']} ({'usable' if ipex['usable'] else ipex['reason']})" if ipex["version"] else ipex["reason"]
    )
    cpu, choices, cache, model = info["cpu"], info["choices"], info["prepared_cache"], info["model"]
    capped = ", ".join(f"{k}={v}" for k, v in cpu["isa_capped_by"].items())
    tier = cpu["isa_tier"] + (f" (hardware {cpu['hardware_isa_tier']}, capped by {capped})" if capped else "")
    others = ", ".join(f"--model {version} ({hub_id})" for version, hub_id in model["versions"].items()
                       if hub_id != model["default"])  # fmt: skip
    lines = [
        f"Model:      {model['default']} ({model['protocol_version']} protocol; MinerU 4's model); {others}",
        "Renderer:   "
        + (
            f"DocVortex {info['renderer']['docvortex']} (MinerU 4's: every target of parse -f)"
            if info["renderer"]["docvortex"]
            else "mineru-fast's own (bundle, Markdown, content list); pip install 'mineru-fast[mineru4]' for DocVortex"
        ),
        f"CPU:        {cpu['model']} ({cpu['vendor']}), ISA class {tier}; "
        f"bf16 {'native' if cpu['native_bf16'] else 'emulated'}, int8 VNNI {'yes' if cpu['vnni'] else 'no'}",
        f"ISA:        {isa}; AMX: {amx}",
        f"Topology:   {t['sockets']} socket(s), {t['physical_cores']} physical core(s), "
        f"{t['logical_cpus']} logical CPU(s), {len(t['numa_nodes'])} NUMA node(s)",
        *[f"  node {n['id']}: cpus {n['cpus']}, memory {n['memory_gb'] or '?'} GB" for n in t["numa_nodes"]],
        f"Allowed:    cpus {a['cpus']} ({a['physical_cores']} physical core(s)), cgroup quota "
        f"{a['cgroup_quota_cpus'] or 'none'} -> {a['usable_cores']} usable core(s)",
        f"Threads:    intra-op {th['intra_op']}, inter-op {th['inter_op']}, OpenMP {th['openmp']}",
        f"  parse would set: {' '.join(f'{k}={v}' for k, v in th['sets'].items()) or 'nothing'}",
        f"  kept (user-set): {' '.join(f'{k}={v}' for k, v in th['kept_user_set'].items()) or 'nothing'}",
        f"Backends:   stock (torch {b['torch']}, transformers {b['transformers']}); IPEX " + ipex_line,
        f"  auto chooses: {b['auto_chooses']['backend']} (INT8 by {b['auto_chooses']['int8']}): "
        f"{b['auto_chooses']['reason']}",
        f"Presets:    auto runs {choices['auto_preset']['candidate']} ({choices['auto_preset']['preset']} preset"
        + "".join(f", {k}={v}" for k, v in choices["auto_preset"]["overrides"].items())
        + f"): {choices['auto_preset']['reason']}",
        f"  int8_kernel=auto (fast preset: the vision linears' per-token INT8) runs "
        f"{choices['int8_kernel_auto']['kernel']}: "
        f"{choices['int8_kernel_auto']['reason']}",
        f"  the fast preset's language model runs {choices['lm_quant_fast']['quant']}: "
        f"{choices['lm_quant_fast']['reason']}",
        f"  the fast preset's vision attention: {choices['vision_attention_fast']['reason']}",
        f"  the fast preset's vision linears: {choices['vision_linears_fast']['reason']}",
        "Prepared:   "
        + (
            f"{cache['root']}: {cache['entries']} prepared model(s), {cache['bytes'] / 1e9:.2f} GB "
            "(loaded at start instead of quantizing; bench prints the memory table)"
            if cache["root"]
            else "cache off (MINERU_FAST_PREPARED_CACHE)"
        ),
    ]
    return "\n".join(lines)
