"""Dynamic INT8 kernels: the documented math, per-token vs per-tensor, exactness on every ISA class;
block-wise INT8's PyTorch form (the kernel itself: test_kernels.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mineru_fast.engine.quantize import (
    UPCAST_CHUNK_MAX_ROWS,
    Bf16WeightsLinear,
    BlockInt8Linear,
    Int8BlockConfig,
    Int8DynamicConfig,
    int8_kernel_path,
    int8_weight_max,
    quantize_,
    quantize_linear,
    resolve_int8_backend,
)
from mineru_fast.runtime.cpu import simulation_env

PER_TOKEN = ("onednn", "int_mm")


def _layer(backend: str, k: int = 96, n: int = 40, seed: int = 0) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n)
    copy = nn.Linear(k, n)
    copy.load_state_dict(linear.state_dict())
    return linear, quantize_(nn.Sequential(copy), Int8DynamicConfig(backend))[0]


def _expected(linear: nn.Linear, x: torch.Tensor, wmax: int, half_up: bool) -> torch.Tensor:
    """The module docstring's math in float64: symmetric per-channel weights to +-wmax, symmetric
    per-token activations to +-127, exact integer products, both scales, bias."""
    w = linear.weight.detach().double()
    w_scale = w.abs().amax(1) / wmax
    w_q = torch.round(w / w_scale[:, None])
    absmax = x.double().abs().amax(1, keepdim=True)
    v = x.double() * (127 / absmax)
    x_q = torch.floor(v + 0.5) if half_up else torch.round(v)
    return (x_q @ w_q.t()) * absmax / 127 * w_scale + linear.bias.detach().double()


@pytest.mark.parametrize("backend", PER_TOKEN)
def test_per_token_kernels_compute_the_documented_math(backend):
    linear, quantized = _layer(backend)
    x = torch.randn(7, 96)
    with torch.inference_mode():
        got = quantized(x)
    expected = _expected(linear, x, int8_weight_max(backend), half_up=backend == "onednn")
    # Same integers; float32 scaling of sums up to ~1e6 leaves ~1e-6 relative error.
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32 and quantized(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", [*PER_TOKEN, "torch_ao"])
def test_only_torch_ao_lets_one_token_change_the_others(backend):
    """Per-token scales: an outlier row leaves every other row's output bit-identical. The
    per-tensor kernel's one scale follows the outlier and coarsens the other rows."""
    _, quantized = _layer(backend)
    x = torch.randn(6, 96)
    loud = x.clone()
    loud[0] *= 1000
    with torch.inference_mode():
        same = torch.equal(quantized(x)[1:], quantized(loud)[1:])
    assert same == (backend in PER_TOKEN)


def test_backend_names():
    assert resolve_int8_backend("auto") == "onednn"  # oneDNN's quantized linear ops ship in torch 2.13 CPU
    assert resolve_int8_backend("torch_ao") == "torch_ao"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_int8_backend("fbgemm")
    with pytest.raises(ValueError, match="backend must be one of"):
        Int8DynamicConfig("fbgemm")
    assert "per token" in int8_kernel_path("onednn") and "per tensor, 7-bit" in int8_kernel_path("torch_ao")


_PROBE = """
import json, torch
from torch import nn
from mineru_fast.engine.quantize import Int8DynamicConfig, int8_weight_max, quantize_
torch.manual_seed(0)
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for backend in ("onednn", "int_mm"):
    linear = nn.Linear(256, 24, bias=False)
    w = linear.weight.detach().double()
    wmax = int8_weight_max(backend)
    w_q = torch.round(w / (w.abs().amax(1) / wmax)[:, None])
    x = torch.randn(16, 256)
    x[:, :64] = x[:, :64].sign() * x.abs().amax(1, keepdim=True)  # many +-127 codes: worst case for 16-bit sums
    x_q = torch.round(x.double() * 127 / x.double().abs().amax(1, keepdim=True))
    layer = quantize_(nn.Sequential(linear), Int8DynamicConfig(backend))[0]
    with torch.inference_mode():
        y = layer(x).double()
    exact = (x_q @ w_q.t()) * x.double().abs().amax(1, keepdim=True) / 127 * (w.abs().amax(1) / wmax)
    out[backend] = {"weight_max": wmax, "max_rel_err": float(((y - exact).abs() / exact.abs().max()).max())}
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["avx2", "avx512", "native"])
def test_integer_products_are_exact_on_every_isa_class(isa):
    """Without VNNI, int8 GEMMs sum u8 x s8 pairs in saturating 16-bit registers; the probe must
    notice and drop to 7-bit weights, so results stay exact. Each class runs in a subprocess with
    the simulation variables set before torch loads."""
    env = {**os.environ, **(simulation_env(isa) if isa != "native" else {})}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if isa == "avx2":
        assert out["capability"] == "AVX2"
    for backend in PER_TOKEN:
        if isa != "native":  # AVX2 and AVX-512 without VNNI saturate 8-bit products
            assert out[backend]["weight_max"] == 63
        # Exact integers; the float32 scaling leaves ~1e-7 of the output range.
        assert out[backend]["max_rel_err"] < 1e-5, (isa, backend, out)


@pytest.mark.parametrize("kernel", PER_TOKEN)
def test_per_token_rows_do_not_depend_on_their_batch_neighbours(kernel):
    """Per-token INT8 gives a row the same output alone and in a batch with an outlier row (its
    scale is its own and int32 sums are exact); per-tensor INT8's one scale follows the outlier."""
    torch.manual_seed(0)
    linear = nn.Linear(896, 1152)
    x = torch.randn(16, 896)
    x[3] *= 20  # a neighbour with large activations
    layer = quantize_linear(linear, Int8DynamicConfig(kernel))
    assert torch.equal(layer(x[:1]), layer(x)[:1])
    per_tensor = quantize_linear(linear, Int8DynamicConfig("torch_ao"))
    assert not torch.equal(per_tensor(x[:1]), per_tensor(x)[:1])


def test_onednn_row_groups_give_the_same_outputs_bit_for_bit():
    """A oneDNN layer packed by row groups (the vision attention's qkv, for memory) computes every
    output with the same integers and float steps: its whole output, each group's outputs from
    ``row_group_outputs`` and a layer restored from its prepared state equal the one-pack layer's
    bit for bit; a grouping that is not a partition of the rows is refused."""
    from mineru_fast.engine.quantize import OneDnnInt8Linear

    torch.manual_seed(0)
    linear = nn.Linear(96, 48)
    x = torch.randn(37, 96)
    whole = OneDnnInt8Linear(linear)
    grouped = OneDnnInt8Linear(linear)
    groups = torch.randperm(48).view(4, 12)
    grouped.pack_row_groups(groups)
    # int8 weights (on the own AVX2 GEMM: outputs padded to panels of 32, with an int32 offset each);
    # grouped, also the rows (int64), scales and bias
    if whole.own_gemm:
        assert whole.packed_bytes() == 64 * (96 + 4)
        assert grouped.packed_bytes() == 4 * 32 * (96 + 4) + 48 * (8 + 4 + 4)
    else:
        assert whole.packed_bytes() == 48 * 96
        assert grouped.packed_bytes() == 48 * 96 + 48 * (8 + 4 + 4)
    expected = whole(x)
    assert torch.equal(grouped(x), expected)
    parts = list(grouped.row_group_outputs(x))
    assert [p.shape for p in parts] == [(37, 12)] * 4
    assert all(torch.equal(part, expected[:, rows]) for part, rows in zip(parts, groups, strict=True))
    state = grouped.prepared_state()
    assert torch.equal(state["weight_q"], whole.prepared_state()["weight_q"])  # stored in row order
    restored = OneDnnInt8Linear.from_prepared(state)
    assert torch.equal(restored.row_groups, groups) and torch.equal(restored(x), expected)
    with pytest.raises(ValueError, match="output rows"):
        grouped.pack_row_groups(torch.arange(47).view(1, 47))
    with pytest.raises(ValueError, match="packed whole"):
        next(whole.row_group_outputs(x))


def test_int32_products_are_scaled_in_their_own_storage_to_the_same_values():
    """``_scaled`` (the ``int_mm`` and ``gemv`` GEMM paths) converts the int32 products to float32
    in place and scales them: the values of ``torch.mul(acc, scale)``, in ``acc``'s storage."""
    from mineru_fast.engine.quantize import _scaled

    torch.manual_seed(0)
    for m, n in ((1, 7), (3, 1000), (37, 4864), (512, 9728)):
        acc = torch.randint(-(2**24), 2**24, (m, n), dtype=torch.int32)
        scale = torch.rand(n)
        expected = torch.mul(acc, scale)
        got = _scaled(acc, scale)
        assert got.dtype == torch.float32 and got.data_ptr() == acc.data_ptr()
        assert torch.equal(got, expected)


def _blockwise_expected(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``Int8BlockConfig``'s math in float64, written from its definition (not from the packed
    layout): 32-value blocks of each weight row and each activation row, symmetric to +-127
    (weights ``round(w / s)``, activations ``round(x * (127 / max))``, both half to even), exact
    integer products per block, each block's sum times both its scales, summed over blocks, bias."""
    n, k = linear.weight.shape
    pad = -k % 32
    w = F.pad(linear.weight.detach().float(), (0, pad)).view(n, -1, 32)
    w_scale = w.abs().amax(2) / 127
    w_q = torch.round(w / w_scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).double()
    xb = F.pad(x.float(), (0, pad)).view(x.shape[0], -1, 32)
    amax = xb.abs().amax(2)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    x_q = torch.round(xb * inv[..., None]).double()
    dots = torch.einsum("mbk,nbk->mnb", x_q, w_q)  # exact: integers far below 2**53
    y = (dots * (amax / 127).double()[:, None, :] * w_scale.double()[None]).sum(2)
    return y if linear.bias is None else y + linear.bias.detach().double()


@pytest.mark.parametrize(("n", "k", "bias"), [(40, 96, True), (50, 70, False), (16, 32, True), (3, 5, True)])
def test_block_int8_reference_computes_the_documented_math(n, k, bias):
    """The PyTorch form of the block kernel (what runs without it, and what the kernel is checked
    against): its packed layout and padding (N to 16, K to 32) unpack to the definition's values.
    Tolerance: the float32 sum over blocks against float64 (rounding ~1e-7 relative per step)."""
    torch.manual_seed(n * k)
    linear = nn.Linear(k, n, bias=bias)
    layer = BlockInt8Linear(linear)
    layer._bound = None  # the reference path, even where the kernel is built
    x = torch.randn(7, k) * torch.logspace(-2, 2, 7)[:, None]
    x[0] = 0.0  # an all-zero row: scale 0, output = bias
    x[1, : min(k, 32)] = 0.0  # and an all-zero block inside a row
    got, expected = layer(x).double(), _blockwise_expected(linear, x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # against the float layer: within 32-value INT8 rounding (each product's relative error is
    # about 1/254 per factor, summed over random signs; 2 % of the output's norm is far above it)
    reference = linear(x).detach().double()
    assert float((got - reference).norm()) < 0.02 * float(reference.norm())
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16 and layer(x[None]).shape == (1, 7, n)


def test_block_int8_rows_do_not_depend_on_their_batch_neighbours():
    torch.manual_seed(3)
    layer = BlockInt8Linear(nn.Linear(64, 48))
    layer._bound = None
    x = torch.randn(6, 64)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(6)])
    x_loud = x.clone()
    x_loud[5] *= 1000  # one loud row: per-tensor scales would coarsen every other row
    assert torch.equal(layer(x), alone) and torch.equal(layer(x_loud)[:5], alone[:5])


def test_block_int8_prepared_state_round_trips():
    torch.manual_seed(4)
    layer = BlockInt8Linear(nn.Linear(70, 50))
    restored = BlockInt8Linear.from_prepared(layer.prepared_state())
    x = torch.randn(3, 70)
    assert (restored.in_features, restored.out_features) == (70, 50) and torch.equal(restored(x), layer(x))
    assert isinstance(quantize_linear(nn.Linear(8, 8), Int8BlockConfig()), BlockInt8Linear)


@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [(64, 151_936, False), (896, 1152, True), (896, 4864, False), (4864, 896, False), (896, 40_000, False)],
)
def test_bf16_weights_give_a_float32_copys_outputs(in_features, out_features, bias):
    """A prefill (the whole weight at once) equals ``F.linear`` on a float32 copy of the bfloat16
    weight bit for bit; decode rows (upcast by chunks of output rows) equal it up to the order of
    the float32 sums, which the GEMM picks per shape (bit for bit on the AMD EPYC; a few ulps for
    rows 4-15 on an AMX Xeon): each output within 2 * in * 2**-24 * sum_i |x_i w_i| (twice the
    standard bound of one summation order's error), where a wrong chunk, a lost bias or a
    bfloat16 product would be off by far more. The tiny model's head, the full model's qkv (with
    bias), MLP and part of its head."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    layer = Bf16WeightsLinear(linear)
    weight = linear.weight.detach().to(torch.bfloat16).float()
    b = None if linear.bias is None else linear.bias.detach()

    def assert_summation_order_only(x: torch.Tensor) -> None:
        bound = 2 * in_features * 2**-24 * (x.abs() @ weight.abs().T)
        difference = (layer(x) - F.linear(x, weight, b)).abs()
        assert torch.all(difference <= bound), (tuple(x.shape), (difference - bound).max().item())

    for rows in range(1, UPCAST_CHUNK_MAX_ROWS + 1):
        assert_summation_order_only(torch.randn(rows, in_features))
    x = torch.randn(40, in_features)
    assert torch.equal(layer(x), F.linear(x, weight, b))
    x = torch.randn(3, 1, in_features)  # [batch, 1, in]: a decode step's shape is kept
    assert layer(x).shape == (3, 1, out_features)
    assert_summation_order_only(x)
