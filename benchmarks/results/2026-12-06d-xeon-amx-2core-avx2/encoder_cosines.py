"""How far rounding alone moves the full-size synthetic vision encoder's output (a measurement
kept with its results; not part of the package): one layout image (74 x 74 patches, the fast
preset's INT8 linears) with its attention in float32 SDPA, in float64 SDPA (cast back to float32)
and on the own float32 kernel; the cosine of each pair of outputs. Run with
mineru_fast.runtime.cpu.simulation_env("avx2")'s variables set: python encoder_cosines.py MODEL_DIR.
"""

import sys

import torch
import torch.nn.functional as F

from mineru_fast.engine.generate import FastEngine
from mineru_fast.engine.kernels import f32_attention_kernel
from mineru_fast.engine.quantize import Int8DynamicConfig
from mineru_fast.runtime.choice import choose_int8_kernel
from mineru_fast.runtime.cpu import read_topology


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    heads, _, d = q.shape
    attended = F.scaled_dot_product_attention(q[None].double(), k[None].double(), v[None].double())[0]
    out[:, : heads * d].unflatten(1, (heads, d)).copy_(attended.float().transpose(0, 1))


def main() -> None:
    torch.set_num_threads(2)
    kernel = choose_int8_kernel("auto", read_topology()).value
    engine = FastEngine(
        sys.argv[1], slots=1, max_seq_len=4096, vision_attention="fp32", vision_quant=Int8DynamicConfig(kernel)
    )
    patches = torch.randn(74 * 74, engine.vision.config.patch_dim, generator=torch.Generator().manual_seed(0))
    outputs = {}
    with torch.inference_mode():
        attentions = {"sdpa_fp32": None, "sdpa_fp64": float64_attention, "own_f32": f32_attention_kernel()}
        for name, attention in attentions.items():
            engine.vision.use_attention_kernel(attention)
            outputs[name] = engine.vision(patches, [(1, 74, 74)]).flatten()
    names = list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            print(f"{a} vs {b}: cosine {F.cosine_similarity(outputs[a], outputs[b], dim=0).item():.7f}")


if __name__ == "__main__":
    main()
