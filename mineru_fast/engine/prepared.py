"""A persistent cache of the prepared model: every layer as the fast engine runs it (INT8 weights
with their scales, float norms and biases, the embedding table), written once, read at next start.

Preparing a MinerU2.5 checkpoint (reading 2.3 GB of bfloat16, quantizing 1.1 billion weights per
output channel, packing them for oneDNN) is most of a start-up. A prepared entry holds the result:
one safetensors file per linear layer (the INT8 weights and scales: loading is a read and, for
oneDNN, a repack, no arithmetic), one per module for everything else, and a ``manifest.json``.
Loading reads each layer's file through safetensors' memory map and lets it go once the layer is
built, so only one layer's file pages are resident at a time; the embedding table stays mapped,
and only the rows a document uses are ever read into memory.

An entry's key hashes everything its contents depend on: the checkpoint (path, and the size and
modification time of its ``config.json`` and ``*.safetensors``), the engine's settings (dtype,
quantization of each part, the INT8 kernel and the weight range its probe found on this CPU),
this package's version and the code of the modules that make prepared layers, PyTorch's version
and the CPU capability PyTorch dispatches to. Any change gives a new key; an entry that only an
older file of the same checkpoint could use is removed when the new one is committed, and what
killed writers left behind is swept away by the next writer.

Writes are safe against a crash and against several processes preparing the same model at once:
an entry is written into a private temporary folder and committed by renaming it into place (a
rename onto an existing entry fails, and the loser drops its copy). Committing an entry also
removes the entries of the same checkpoint folder that this code can never use again (another
format, an older file of the checkpoint, an older build of this package) in the same environment.

Entries are verified before use: the manifest records the XXH3-128 digest of every file the writer
wrote, and ``load`` hashes the files before it reads them (~0.15 s for a full-size entry on this
project's EPYC; SHA-256, 1.7 GB/s against XXH3's ~20, added ~1.9 s to a warm start on 2 cores).
An entry that fails to load or to verify (a truncated, missing, damaged or altered file, a
manifest of another format or of another key) is removed and the model prepared again: a flipped
byte in a weight would otherwise compute other numbers silently, and one in a file's header would
fail every request of every later start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from mineru_fast.engine.memory import trim_heap
from mineru_fast.engine.quantize import (
    Bf16WeightsLinear,
    BlockInt8Linear,
    GemvInt8Linear,
    Int8BlockConfig,
    Int8DynamicConfig,
    Int8WeightOnlyConfig,
    Int8WeightOnlyLinear,
    IntMmInt8Linear,
    OneDnnInt8Linear,
    int8_weight_max,
    resolve_int8_backend,
)

logger = logging.getLogger(__name__)

FORMAT = 4  # bumped whenever the files' layout or meaning changes (4: the manifest's XXH3-128 digests)
MANIFEST = "manifest.json"
_HASH_CHUNK = 8 << 20  # bytes read per step while hashing a file

# Layer kinds an entry can hold, by class; a model with any other kind of layer (torch.ao's
# quantized linear, IPEX's) is not cached.
_KINDS: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    OneDnnInt8Linear: "onednn",
    GemvInt8Linear: "gemv",
    IntMmInt8Linear: "int_mm",
    Int8WeightOnlyLinear: "int8_weight_only",
    BlockInt8Linear: "int8_block",
    Bf16WeightsLinear: "bf16_weights",
}
_PACKED_ANEW = {"onednn": ("weight_q",)}  # tensors copied into another form when a layer is restored
_RESTORE: dict[str, Callable[[dict[str, torch.Tensor]], nn.Module]] = {
    "onednn": OneDnnInt8Linear.from_prepared,
    "gemv": GemvInt8Linear.from_prepared,
    "int_mm": IntMmInt8Linear.from_prepared,
    "int8_weight_only": Int8WeightOnlyLinear.from_prepared,
    "int8_block": BlockInt8Linear.from_prepared,
    "bf16_weights": Bf16WeightsLinear.from_prepared,
}


class PreparedCacheError(Exception):
    """An entry cannot be read or verified (a missing, truncated, damaged or altered file, another
    format or key); it is then rebuilt."""


def file_digest(path: Path) -> str:
    """The XXH3-128 digest of a file's bytes, as 32 hex digits, read in chunks of ``_HASH_CHUNK``
    bytes (not mapped: a mapped file's pages would count in the process's resident size).

    XXH3 is a checksum, not a cryptographic hash: it tells a damaged or cut file, not one forged
    by someone who can also rewrite the manifest beside it.

    Raises:
        OSError: the file cannot be read.
    """
    digest, buffer = xxhash.xxh3_128(), bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def _damaged(entry: Path, digests: dict[str, str]) -> list[str]:
    """The files of ``entry`` whose bytes are not those ``digests`` (file name -> XXH3-128) records,
    or that cannot be read."""
    damaged = []
    for name, expected in digests.items():
        try:
            if file_digest(entry / name) != expected:
                damaged.append(name)
        except OSError:
            damaged.append(name)
    return damaged


def checkpoint_identity(model_dir: Path) -> dict[str, Any]:
    """The checkpoint part of a key: the resolved path and ``[name, size, mtime_ns]`` of its
    ``config.json`` and ``*.safetensors`` files."""
    model_dir = model_dir.resolve()
    files = sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]
    return {
        "path": str(model_dir),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.exists()],
    }


def _code_digest() -> str:
    """A hash of the modules that decide what a prepared layer holds (quantization, loading, this
    module): an editable install keeps its version number across code changes."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in ("quantize.py", "checkpoint.py", "prepared.py", "vision.py"):  # vision: qkv's head groups
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mineru-fast")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "source"


class PreparedCache:
    """The prepared-model entries under ``root`` (``hub.prepared_cache_root()`` by default).

    Args:
        root: folder of the entries (created on first write).
        model_dir: the checkpoint.
        settings: the engine settings the prepared layers depend on (JSON-serializable).
    """

    def __init__(self, root: Path, model_dir: Path, settings: dict[str, Any]) -> None:
        self.root = Path(root)
        self.identity: dict[str, Any] = {
            "format": FORMAT,
            "checkpoint": checkpoint_identity(Path(model_dir)),
            "settings": settings,
            "mineru_fast": _package_version(),
            "code": _code_digest(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        }
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()
        self.path = self.root / digest[:32]

    def exists(self) -> bool:
        """Whether a committed entry for this key is present."""
        return (self.path / MANIFEST).is_file()

    # -- reading -------------------------------------------------------------------------------

    def load(self, vision: nn.Module, lm: nn.Module) -> None:
        """Fill the meta-device ``vision`` and ``lm`` modules from the entry, in place, once every
        file the manifest lists matches its digest (``file_digest``: ~0.15 s for a full-size entry
        in the page cache on 2 EPYC cores; hashed in a thread beside the load it cost ~1 s more,
        the two contending for the interpreter).

        Raises:
            PreparedCacheError: the entry is incomplete, truncated, damaged or altered (a file
                that does not match its digest, named in the message), of another format, or
                another key's.
        """
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
            if manifest.get("format") != FORMAT:
                raise PreparedCacheError(f"entry format {manifest.get('format')}, expected {FORMAT}")
            if json.dumps(manifest.get("identity"), sort_keys=True) != json.dumps(self.identity, sort_keys=True):
                raise PreparedCacheError("the entry was written for another checkpoint, settings or version")
            damaged = _damaged(self.path, dict(manifest["digests"]))
            if damaged:
                raise PreparedCacheError(
                    f"{', '.join(damaged)} does not match the digest recorded when it was written (a damaged or "
                    "altered file)"
                )
            self._read(manifest, vision, lm)
        except (PreparedCacheError, OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
            raise PreparedCacheError(f"prepared model {self.path.name} cannot be read: {exc}") from exc

    def _read(self, manifest: dict[str, Any], vision: nn.Module, lm: nn.Module) -> None:
        """Fill ``vision`` and ``lm`` from the entry's files as ``manifest`` lists them."""
        for part, module in (("vision", vision), ("lm", lm)):
            rest = load_file(self.path / f"{part}.safetensors")
            module.load_state_dict(rest, strict=False, assign=True)
            del rest
            for name, kind in manifest["layers"][part].items():
                if kind == "tied":  # the LM head is the embedding matrix itself
                    weight = module.get_parameter(manifest["tied"][name])
                    layer: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                    layer.weight = weight
                else:
                    mapped = load_file(self.path / f"{part}.{name}.safetensors")
                    # Tensors the layer keeps are copied out of the map, so the file's pages
                    # are let go with it; a weight that is packed anew is read from it once.
                    packed = _PACKED_ANEW.get(kind, ())
                    layer = _restore(kind, {k: v if k in packed else v.clone() for k, v in mapped.items()})
                    del mapped
                _replace(module, name, layer)
                trim_heap()
            _check_complete(module, part)

    def mapped(self, part: str, name: str) -> nn.Parameter:
        """The committed entry's tensor ``name`` of ``part``'s non-linear file, memory-mapped (pages
        are read in as they are used), as a parameter.

        Raises:
            PreparedCacheError: the entry or the tensor is missing.
        """
        try:
            return nn.Parameter(load_file(self.path / f"{part}.safetensors")[name], requires_grad=False)
        except (OSError, KeyError, SafetensorError) as exc:
            raise PreparedCacheError(f"prepared model {self.path.name} cannot be read: {exc}") from exc

    def discard(self) -> None:
        """Remove this key's entry (a reader holding its files keeps them until it lets go)."""
        _remove(self.path)

    # -- writing -------------------------------------------------------------------------------

    def writer(self) -> PreparedWriter:
        """A writer for this key's entry (see ``PreparedWriter``)."""
        return PreparedWriter(self)


class PreparedWriter:
    """Collects a model's layers as they are prepared and commits them as one entry.

    ``add(part, name, layer)`` writes a prepared linear at once (so nothing extra stays in memory);
    ``commit(vision, lm)`` writes the remaining tensors and the manifest and moves the entry into
    place. An unsupported layer abandons the entry (``ok`` turns False) without failing the load.
    """

    def __init__(self, cache: PreparedCache) -> None:
        self.cache = cache
        self.tmp = cache.root / f".tmp-{cache.path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.layers: dict[str, dict[str, str]] = {"vision": {}, "lm": {}}
        self.digests: dict[str, str] = {}  # file name -> XXH3-128 of what was written
        self.ok = True
        self.problem: str | None = None  # why the entry was given up, once it is
        _sweep(cache.root)
        try:
            self.tmp.mkdir(parents=True)
        except OSError as exc:
            self._abandon(f"cannot create {self.tmp}: {exc}")

    def _abandon(self, why: str) -> None:
        if self.ok:
            logger.info("prepared model not cached: %s", why)
            self.problem = why
        self.ok = False
        _remove(self.tmp)

    def add(self, part: str, name: str, layer: nn.Module) -> None:
        """Write one prepared linear of ``part`` (``"vision"`` or ``"lm"``) named ``name``."""
        if not self.ok:
            return
        kind = _KINDS.get(type(layer))
        if kind is None:
            self._abandon(f"{part}.{name} is a {type(layer).__name__}, which the cache does not store")
            return
        if isinstance(layer, nn.Linear):
            state = {"weight": layer.weight, **({"bias": layer.bias} if layer.bias is not None else {})}
        else:
            state = cast(Any, layer).prepared_state()
        try:
            self._save({k: v.detach().contiguous() for k, v in state.items()}, f"{part}.{name}.safetensors")
        except (OSError, SafetensorError) as exc:  # safetensors reports I/O errors (a full disk) as its own
            self._abandon(f"cannot write {self.tmp}: {exc}")
            return
        self.layers[part][name] = kind

    def _save(self, tensors: dict[str, torch.Tensor], file_name: str) -> None:
        """Write ``tensors`` as the entry's file ``file_name`` and record its digest."""
        save_file(tensors, self.tmp / file_name)
        self.digests[file_name] = file_digest(self.tmp / file_name)

    def commit(self, vision: nn.Module, lm: nn.Module) -> bool:
        """Write the non-linear tensors and the manifest, then move the entry into place.

        A tied LM head (the same tensor as the embedding) is recorded as tied, not written twice.

        Returns:
            Whether this call committed the entry (False: abandoned, or another process was first).
        """
        if not self.ok:
            return False
        tied: dict[str, str] = {}
        try:
            for part, module in (("vision", vision), ("lm", lm)):
                linears = self.layers[part]
                rest = {k: v.detach().contiguous() for k, v in module.state_dict().items()
                        if k.rpartition(".")[0] not in linears}  # fmt: skip
                self._save(rest, f"{part}.safetensors")
                del rest
                head = getattr(module, "lm_head", None)
                if isinstance(head, nn.Linear) and head.weight is module.get_parameter("embed.weight"):
                    self.layers[part]["lm_head"] = "tied"
                    tied["lm_head"] = "embed.weight"
                    (self.tmp / f"{part}.lm_head.safetensors").unlink(missing_ok=True)
                    self.digests.pop(f"{part}.lm_head.safetensors", None)
            manifest = {
                "format": FORMAT, "identity": self.cache.identity, "layers": self.layers, "tied": tied,
                "digests": self.digests,
            }  # fmt: skip
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            os.rename(self.tmp, self.cache.path)
        except SafetensorError as exc:  # an I/O error while writing (a full disk)
            self._abandon(f"cannot write {self.tmp}: {exc}")
            return False
        except OSError as exc:
            # ENOTEMPTY / EEXIST: another process committed the same entry first; ours is redundant
            self._abandon(f"{self.cache.path.name} not committed ({exc.strerror or exc})")
            return False
        self._remove_stale()
        logger.info("prepared model cached in %s", self.cache.path)
        return True

    def _remove_stale(self) -> None:
        """Drop committed entries this code supersedes: the same checkpoint folder, settings,
        PyTorch and CPU capability, and another entry format, build of this package or file of
        the checkpoint (audit round 4: entries of old formats piled up, 1.4 GB each). Entries of
        another PyTorch, CPU capability or settings may be another environment's, and are kept."""
        kept = ("settings", "torch", "cpu_capability")
        mine = self.cache.identity
        for manifest_path in self.cache.root.glob(f"*/{MANIFEST}"):
            entry = manifest_path.parent
            if entry == self.cache.path:
                continue
            try:
                other = json.loads(manifest_path.read_text())["identity"]
                same_path = other["checkpoint"]["path"] == mine["checkpoint"]["path"]
                same_environment = all(other[key] == mine[key] for key in kept)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if same_path and same_environment:
                _remove(entry)


def _config_setting(config: object | None) -> str:
    if config is None:
        return "float"
    if isinstance(config, Int8DynamicConfig):
        backend = resolve_int8_backend(config.backend)
        weights = f":+-{int8_weight_max(backend)}" if backend != "torch_ao" else ""
        return f"int8-dynamic:{backend}{weights}"  # the weight range follows the CPU's int8 products
    return type(config).__name__


def prepared_settings(dtype: torch.dtype, configs: dict[str, object | None]) -> dict[str, str]:
    """The engine settings a prepared model depends on: the activation dtype and each part's
    quantization (for dynamic INT8 the kernel and the weight range its probe found here)."""
    return {"dtype": str(dtype), **{part: _config_setting(config) for part, config in configs.items()}}


def cacheable(configs: Iterable[object | None]) -> bool:
    """Whether a model prepared with ``configs`` (each part's quantization config, None = float)
    is worth caching and can be: some part is INT8 (quantization is the work a cache saves) and
    no part uses ``torch.ao``'s kernel, whose packed weights the cache does not store."""
    configs = list(configs)
    if any(isinstance(c, Int8DynamicConfig) and resolve_int8_backend(c.backend) == "torch_ao" for c in configs):
        return False
    return any(isinstance(c, Int8DynamicConfig | Int8BlockConfig | Int8WeightOnlyConfig) for c in configs)


def _restore(kind: str, state: dict[str, torch.Tensor]) -> nn.Module:
    if kind == "linear":
        weight = state["weight"]
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in state, device="meta")
        layer.load_state_dict(state, strict=True, assign=True)
        return layer
    if kind not in _RESTORE:
        raise PreparedCacheError(f"unknown layer kind {kind!r}")
    return _RESTORE[kind](state)


def _replace(module: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, child, layer)


def _check_complete(module: nn.Module, part: str) -> None:
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise PreparedCacheError(f"{part} tensors missing from the entry: {left[:5]}")


# A temporary folder older than this is a killed writer's: preparing a model takes well under a
# minute on 2 cores (the full-size model: 17 s), so no live writer is near it.
ABANDONED_AFTER_S = 3600


def _sweep(root: Path) -> None:
    """Remove what killed processes left under ``root``: ``.trash-*`` folders, and ``.tmp-*``
    folders not written to for ``ABANDONED_AFTER_S`` (age, not the pid in the name, decides: a
    cache shared between machines sees other machines' pids)."""
    if not root.is_dir():
        return
    now = time.time()
    for leftover in [*root.glob(".trash-*"), *root.glob(".tmp-*")]:
        try:
            old = now - leftover.stat().st_mtime > ABANDONED_AFTER_S
        except OSError:
            continue
        if leftover.name.startswith(".trash-") or old:
            shutil.rmtree(leftover, ignore_errors=True)


def _remove(path: Path) -> None:
    """Remove an entry or temporary folder: renamed aside first, so a half-removed entry is never
    seen under its key."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
