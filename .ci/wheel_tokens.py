"""One side of CI's wheel check: what an install of mineru-fast computes, as one JSON line.

    python .ci/wheel_tokens.py MODEL_DIR [--no-compiler] [--pytorch-decode-attention]

Run once with the development install and once with the wheel installed into a fresh virtual
environment, from outside the clone and with no compiler on PATH (``--no-compiler`` asserts that);
``.ci/run`` compares the two lines. The fast preset's engine (``DocumentParser.from_pretrained``)
decodes a page's layout request and three crops of it greedily (tokens of the tiny random-weight
model: every one depends on the language model's block-wise INT8), and ``examples/sample.pdf``
is parsed end to end with its replay trace. Printed: where ``mineru_fast`` was imported from, the
engine's numerics, the token ids, and the parse's status and Markdown. ``--pytorch-decode-attention``
keeps the decode attention on PyTorch's operators even where the own kernel runs (the
``avx512_vnni`` and ``avx2`` paths, with other float32 roundings than PyTorch's), for a comparison
with the portable path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pypdfium2

from mineru_fast import DocumentParser, ParserOptions
from mineru_fast.engine.base import GenerationRequest
from mineru_fast.protocol.spec import LayoutBlock, SamplingParams, crop_block, layout_image, prompt_for, sampling_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOKENS = 24  # new tokens per request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--no-compiler", action="store_true", help="fail if a C or C++ compiler is on PATH")
    ap.add_argument("--pytorch-decode-attention", action="store_true", help="never the own decode attention")
    args = ap.parse_args()
    if args.no_compiler:
        found = {name: shutil.which(name) for name in ("cc", "gcc", "c++", "g++", "clang", "clang++")}
        if any(found.values()):
            print(f"a compiler is reachable: {found}", file=sys.stderr)
            return 1
    parser = DocumentParser.from_pretrained(args.model, ParserOptions(progress=False))  # the fast preset
    if args.pytorch_decode_attention:
        parser.engine.lm.use_decode_kernel(None)
        parser.engine.numerics["lm_decode_attention"] = "PyTorch operators and SDPA (--pytorch-decode-attention)"
    page = pypdfium2.PdfDocument(EXAMPLES / "sample.pdf")[0].render(scale=100 / 72).to_pil().convert("RGB")
    requests = [GenerationRequest(layout_image(page), prompt_for("layout"), SamplingParams(max_new_tokens=TOKENS))]
    crops = (("text", (0.1, 0.1, 0.9, 0.3)), ("table", (0.1, 0.4, 0.9, 0.7)), ("equation", (0.3, 0.8, 0.7, 0.9)))
    for kind, box in crops:
        rules = sampling_for(kind)
        params = SamplingParams(rules.presence_penalty, rules.frequency_penalty, 100, TOKENS)
        requests.append(GenerationRequest(crop_block(page, LayoutBlock(kind, box)), prompt_for(kind), params))
    tokens = [result.token_ids for result in parser.engine.generate(requests)]
    document = parser.parse(EXAMPLES / "sample.pdf", replay=EXAMPLES / "sample_trace.json")
    parser.close()
    import mineru_fast

    parse = {"status": document.status, "markdown": document.to_markdown(), "runtime": document.metadata["runtime"]}
    package = str(Path(mineru_fast.__file__).parent)
    print(json.dumps({"package": package, "numerics": parser.runtime, "tokens": tokens, "parse": parse}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
