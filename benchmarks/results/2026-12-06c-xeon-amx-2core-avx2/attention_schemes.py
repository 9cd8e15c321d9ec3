"""Error of reduced-precision vision-attention arithmetics against a float64 reference, on four
synthetic input kinds (a measurement kept with its results; not part of the package).

Each scheme is written out in PyTorch with the roundings it would make; rows are [n, d] for one
head. Printed per scheme: the cosine of all outputs to the reference, the worst row's cosine, and
the largest absolute error over the largest reference output.
Run: python attention_schemes.py   (CPU, ~1 minute)
"""

import math

import torch

LOG2E = 1.4426950408889634


def reference(q, k, v):
    s = (q.double() @ k.double().T) / math.sqrt(q.shape[1])
    return torch.softmax(s, -1) @ v.double()


def bf16(x):
    return x.bfloat16().float()


def bfloat16_scheme(q, k, v):
    """The AVX-512 BF16 kernel's roundings (kernels.h): q, k, v and p rounded to bfloat16."""
    s = bf16(q * q.shape[1] ** -0.5 * LOG2E) @ bf16(k).T
    p = bf16(torch.exp2(s - s.amax(-1, keepdim=True)))
    return (p @ bf16(v)) / p.sum(-1, keepdim=True)


def per_row(x, limit):
    scale = x.abs().amax(-1, keepdim=True) / limit
    scale[scale == 0] = 1
    return torch.round(x / scale).clamp(-limit, limit), scale


def integer_scheme(q, k, v, q_limit, k_limit, p_limit, v_limit, block=128, integer_scores=True):
    """Scores from q and k rounded per row to +-limit (or float32 ones), p per block of keys to
    0..p_limit against the block's largest p, v per column to +-v_limit."""
    d = q.shape[1]
    x = q * d**-0.5 * LOG2E
    if integer_scores:
        qi, qs = per_row(x, q_limit)
        ki, ks = per_row(k, k_limit)
        s = (qi @ ki.T) * qs * ks.T
    else:
        s = x @ k.T
    p = torch.exp2(s - s.amax(-1, keepdim=True))
    v_scale = v.abs().amax(0, keepdim=True) / v_limit
    vi = torch.round(v / v_scale)
    out = torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64)
    total = torch.zeros(q.shape[0], 1, dtype=torch.float64)
    for b in range(0, p.shape[1], block):
        pb = p[:, b : b + block]
        largest = pb.amax(-1, keepdim=True)
        largest[largest == 0] = 1
        pi = torch.round(pb / largest * p_limit).double()
        weight = largest.double() / p_limit
        out += (pi @ vi[b : b + block].double()) * v_scale.double() * weight
        total += pi.sum(-1, keepdim=True) * weight
    return out / total


SCHEMES = {
    "bfloat16 (the AVX-512 BF16 kernel)": bfloat16_scheme,
    "int8 q.k (q 127, k 64), int8 p.v (p 127, v 127)": lambda q, k, v: integer_scheme(q, k, v, 127, 64, 127, 127),
    "float32 q.k, int8 p.v (p 127, v 127)": lambda q, k, v: integer_scheme(
        q, k, v, 0, 0, 127, 127, integer_scores=False
    ),
    "int16 (the tried kernel: q, k 2047, p 8191, v 2047)": lambda q, k, v: integer_scheme(
        q, k, v, 2047, 2047, 8191, 2047
    ),
}


def cases(n=2048, d=80):
    torch.manual_seed(0)
    outlier = lambda scale: torch.where(torch.rand(d) < 0.05, scale, 1.0)  # noqa: E731
    return {
        "gaussian": [torch.randn(n, d) for _ in range(3)],
        "sharp (q, k x4)": [4 * torch.randn(n, d), 4 * torch.randn(n, d), torch.randn(n, d)],
        "biased k, outliers": [
            2 * torch.randn(n, d) + 3 * torch.randn(d),
            2 * torch.randn(n, d) + 6 * torch.randn(d),
            torch.randn(n, d) + 2 * torch.randn(d),
        ],
        "outlier channels": [
            torch.randn(n, d) * outlier(8.0),
            torch.randn(n, d) * outlier(8.0),
            torch.randn(n, d) * outlier(10.0),
        ],
    }


def main():
    for name, (q, k, v) in cases().items():
        expected = reference(q, k, v)
        print(name)
        for scheme, run in SCHEMES.items():
            got = run(q, k, v).double()
            cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), 0).item()
            worst = torch.nn.functional.cosine_similarity(got, expected, 1).min().item()
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            print(f"  {scheme:52s} cosine {cosine:.7f}  worst row {worst:.6f}  max error {error:.2e}")


if __name__ == "__main__":
    main()
