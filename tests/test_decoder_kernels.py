"""The fast preset's language model outside its linears (``kernels.DecoderKernels``): the RMSNorm
(one plain C++ function for every path) computes its documented arithmetic bit for bit, the
SiLU-gated product stays within its stated error of PyTorch's and gives the same bits on the avx2 and
avx512_vnni paths, and a decode step of the whole decoder in one call (``kernels.BoundDecoder``)
gives the same operations one call at a time bit for bit, KV cache included, binding again to
replaced tensors and modules and refusing what it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mineru_fast.engine.kernels as kernels
from mineru_fast.engine.quantize import Int8BlockConfig

STATUS = kernels.kernel_status()
PATHS = [
    p for p in kernels.DECODE_ATTENTION_PATHS if STATUS.block is not None and p in kernels._load_module().cpu_paths()
]
pytestmark = pytest.mark.skipif(STATUS.decoder is None, reason=f"no decoder kernels here: {STATUS.reason}")
BLOCK = {"lm_quant": Int8BlockConfig(), "lm_head_quant": Int8BlockConfig()}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``csrc/kernels.h``'s rms_norm_row in PyTorch's elementwise float32 operators (each one
    correctly rounded, so the same bits): 16 lane sums in order, added as lanes o + 8, o + 4, o + 2,
    o + 1; a true division by n (a tensor, not a scalar PyTorch could turn into a reciprocal); the
    square root in float64, then rounded: correctly rounded, as ``std::sqrt`` (PyTorch's float32
    ``sqrt`` on the CPU is not: 1 ulp off on some inputs, measured)."""
    n = x.shape[-1]
    lanes = torch.zeros(*x.shape[:-1], 16)
    for start in range(0, n, 16):
        chunk = x[..., start : start + 16]
        lanes[..., : chunk.shape[-1]] += chunk * chunk
    width = 8
    while width:
        lanes[..., :width] += lanes[..., width : 2 * width]
        width //= 2
    total = lanes[..., :1]
    mean_eps = total.div(torch.full_like(total, n)) + torch.tensor(eps, dtype=torch.float32)
    inverse = torch.ones_like(total).div(torch.sqrt(mean_eps.double()).float())
    return x * inverse * weight


def rows(count: int, n: int, seed: int = 0) -> torch.Tensor:
    """Rows of every kind: wide and narrow spreads, a zero row, a row with one huge value."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, n, generator=generator) * torch.logspace(-3, 3, count)[:, None]
    if count > 2:
        x[1] = 0
        x[2, n // 3] = 1e18
    return x


@pytest.mark.parametrize(("count", "n"), [(5, 896), (3, 64), (4, 100), (1, 7), (70, 896)])  # tails; > 64 rows: threads
def test_the_rms_norm_computes_its_documented_arithmetic(count, n):
    """Bit for bit against the PyTorch form of its arithmetic, and within 4 float32 ulps of
    ``torch.rms_norm`` (another order of the same sum of squares, and PyTorch's inverse square
    root, which is not correctly rounded). One plain C++ function serves every path."""
    ops = STATUS.decoder
    x = rows(count, n)
    weight = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5
    got = ops.rms_norm(x, weight, 1e-6)
    assert torch.equal(got, rms_norm_reference(x, weight, 1e-6))
    want = torch.rms_norm(x, (n,), weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=4.8e-7, atol=0)
    assert ops.rms_norm(x[:0], weight, 1e-6).shape == (0, n)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("count", "n"), [(3, 4864), (2, 40), (2, 13), (33, 64)])  # 13: 8- and 16-lane tails
def test_the_silu_product_stays_within_its_error_of_pytorchs(path, count, n):
    """``silu(gate) * up`` within 4 float32 ulps of PyTorch's (2^x a polynomial of relative error
    below 3e-7, then a sum, a division and a product, against Sleef's exp in PyTorch's), plus
    |gate| ulps below 0 (the exponent -log2(e) |gate| is rounded to float32 first: an absolute
    error that grows with it), or within 1e-35 |up| where PyTorch's flushes a denormal to 0;
    infinities, NaN and very negative gates as PyTorch gives them (inf, NaN, NaN, -0)."""
    ops = kernels.decoder_kernels(path)
    gate_up = rows(count, 2 * n) * 3
    gate_up[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -200.0])
    got = ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (count, n)
    assert got[0, :3].isinf().tolist() == [True, False, False] and got[0, 1:3].isnan().all()
    assert got[0, 3].item() == 0 and got[0, 3].signbit() == (up[0, 3] > 0)
    finite = want.isfinite()
    error = (got - want).abs()[finite]
    bound = (4.8e-7 + 1.2e-7 * gate.abs()) * want.abs() + 1e-35 * up.abs()
    assert (error <= bound[finite]).all() and got[~finite].isnan().tolist() == want[~finite].isnan().tolist()


@pytest.mark.skipif(len(PATHS) < 2, reason=f"one decoder kernel path runs here ({PATHS})")
def test_the_silu_product_gives_the_same_bits_on_avx2_as_on_avx512():
    wide, narrow = (kernels.decoder_kernels(p) for p in ("avx512_vnni", "avx2"))
    for n in (4864, 13, 40):
        gate_up = rows(5, 2 * n) * 3
        gate_up[0, :3] = torch.tensor([float("inf"), float("-inf"), -200.0])
        got = wide.silu_mul(gate_up)
        assert got[0, 1].isnan() and torch.equal(got.view(torch.int32), narrow.silu_mul(gate_up).view(torch.int32))


def test_the_norm_and_the_silu_product_refuse_what_they_cannot_read():
    ops = STATUS.decoder
    with pytest.raises(ValueError, match="x:"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x:"):
        ops.rms_norm(torch.zeros(8, 2).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight:"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(1, 8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        ops.silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="gate_up:"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float64))


def engine_lm(tiny_model, slots: int = 4):
    from mineru_fast.engine.generate import FastEngine

    engine = FastEngine(tiny_model, precision="fp32", slots=slots, max_seq_len=256, **BLOCK)
    assert "decoder layers in one call" in engine.decode_attention_reason
    return engine.lm


def filled(lm, lengths: list[int]) -> None:
    """Prefill slot ``i`` with ``lengths[i]`` random embeddings."""
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for slot, length in enumerate(lengths):
            embeds = torch.randn(1, length, lm.config.hidden_size, generator=generator)
            lm.prefill(embeds, torch.arange(length).view(1, 1, -1).expand(3, 1, -1), slot)


def one_by_one(lm, tokens: torch.Tensor, positions: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """The one-call decode step's operations one call at a time, as ``csrc/module.cpp``'s
    decode_layers documents them: the decoder kernels' norm and SiLU-gated product, each layer's
    block kernels and the decode attention kernel, PyTorch's residual adds. Logits ``[B, vocab]``."""
    ops, eps, batch = kernels.kernel_status().decoder, lm.config.rms_norm_eps, len(tokens)
    h = lm.embed_tokens(tokens)
    cos, sin = (t.view(batch, -1) for t in lm.rope(positions.view(1, -1, 1).expand(3, -1, 1), h.dtype))
    for layer in lm.decoder_layers:
        attention, ffn = layer.attention, layer.feed_forward
        qkv = attention.wqkv(ops.rms_norm(h, layer.attention_norm.weight, eps))
        out = torch.empty(batch, attention.n_heads * attention.head_dim)
        cache = attention.kv_cache
        attention.decode_kernel(qkv, cos, sin, cache.k, cache.v, row_slots, positions, attention.n_heads, out)
        h = h + attention.wo(out)
        h = h + ffn.w_down(ops.silu_mul(ffn.w_gate_up(ops.rms_norm(h, layer.ffn_norm.weight, eps))))
    return lm._logits(h)


def step(lm, tokens, positions, row_slots=None, way: str = "one call"):
    """One decode step from the caches as they are now, which are put back after it: its logits
    and the caches it wrote. ``way``: ``"one call"`` (``lm.decode``), ``"one by one"`` (the same
    operations from Python), ``"pytorch"`` (``lm.decode`` without the decoder kernels)."""
    caches = [(layer.attention.kv_cache.k.clone(), layer.attention.kv_cache.v.clone()) for layer in lm.decoder_layers]
    tokens, positions = torch.tensor(tokens), torch.tensor(positions)
    decoder = lm._decoder_kernels
    try:
        with torch.inference_mode():
            if way == "one by one":
                logits = one_by_one(
                    lm, tokens, positions, torch.arange(len(tokens)) if row_slots is None else row_slots
                )
            else:
                if way == "pytorch":
                    lm.use_decoder_kernels(None)
                logits = lm.decode(tokens, positions, positions, row_slots)
        written = [
            (layer.attention.kv_cache.k.clone(), layer.attention.kv_cache.v.clone()) for layer in lm.decoder_layers
        ]
    finally:
        lm.use_decoder_kernels(decoder)
        for layer, (k, v) in zip(lm.decoder_layers, caches, strict=True):
            layer.attention.kv_cache.k.copy_(k)
            layer.attention.kv_cache.v.copy_(v)
    return logits, written


def same(a, b) -> bool:
    """Whether two ``step`` results are the same bits: logits, and every layer's keys and values."""
    caches = zip(a[1], b[1], strict=True)
    return torch.equal(a[0], b[0]) and all(
        torch.equal(x, y) for ours, theirs in caches for x, y in zip(ours, theirs, strict=True)
    )


def test_a_decode_step_in_one_call_gives_the_layers_one_by_one_bit_for_bit(tiny_model):
    """Rows of their own slots, and draft rows sharing a slot at consecutive positions
    (speculative decoding): the same logits and KV cache bits as the operations one call at a
    time; within 1e-4 of the logits' scale of PyTorch's norms and SiLU (the decoder kernels off),
    which round otherwise (through INT8 activations: a rounding flip moves a value by a step)."""
    lm = engine_lm(tiny_model)
    filled(lm, [20, 3, 41])
    for tokens, positions, row_slots in (
        ([5, 17, 99], [20, 3, 41], None),
        ([7], [41], torch.tensor([2])),
        ([7, 8, 9], [20, 21, 22], torch.tensor([0, 0, 0])),
    ):
        fused = step(lm, tokens, positions, row_slots)
        assert same(fused, step(lm, tokens, positions, row_slots, way="one by one"))
    pytorch = step(lm, [5, 17, 99], [20, 3, 41], way="pytorch")
    fused = step(lm, [5, 17, 99], [20, 3, 41])
    torch.testing.assert_close(fused[0], pytorch[0], rtol=0, atol=1e-4 * pytorch[0].abs().max().item())
    decoder = lm._decoder_kernels
    lm.use_decode_kernel(None)  # the one-call step needs the decode attention kernel too
    assert lm._decoder is None
    lm.use_decode_kernel(kernels.kernel_status().decode_attention)
    assert lm._decoder is not None and lm._decoder_kernels is decoder


def test_a_decode_step_in_one_call_runs_on_replaced_tensors(tiny_model):
    """A norm weight assigned anew, a scale moved in place, a buffer replaced, new KV caches
    (``setup_cache``) and a replaced linear are what the next step reads; a linear that is no
    longer block-wise, or bfloat16 caches, drop the one-call step."""
    lm = engine_lm(tiny_model)
    filled(lm, [9])
    layer = list(lm.decoder_layers)[-1]
    layer.attention_norm.weight = nn.Parameter(layer.attention_norm.weight.detach() * 3)
    pointers = list(lm._decoder._pointers)
    layer.feed_forward.w_down.weight_scale.share_memory_()  # the same tensor, its storage moved
    buffer = layer.attention.wqkv._buffers["weight_scale"]
    layer.attention.wqkv._buffers["weight_scale"] = buffer.clone() * 0.5
    assert same(step(lm, [4], [9]), step(lm, [4], [9], way="one by one"))
    now = lm._decoder._pointers
    moved = layer.feed_forward.w_down.weight_scale.data_ptr()
    assert now != pointers and moved in now and moved not in pointers
    lm.setup_cache(2, 64, torch.float32)
    filled(lm, [9])
    assert same(step(lm, [4], [9]), step(lm, [4], [9], way="one by one"))
    before = step(lm, [4], [9])
    replaced = copy.deepcopy(layer.attention.wo)  # a new module: the step binds to it
    replaced.weight_scale.mul_(2)
    layer.attention.wo = replaced
    after = step(lm, [4], [9])
    assert same(after, step(lm, [4], [9], way="one by one")) and not torch.equal(after[0], before[0])
    layer.feed_forward.w_down = nn.Linear(lm.config.intermediate_size, lm.config.hidden_size, bias=False)
    with torch.inference_mode():  # no longer block-wise: the layers one by one
        lm.decode(torch.tensor([4]), torch.tensor([9]), torch.tensor([9]))
    assert lm._decoder is None
    lm.setup_cache(1, 64, torch.bfloat16)  # a cache the step cannot read: dropped, not left on the old one
    assert lm._decoder is None


def test_a_decode_step_in_one_call_refuses_what_it_cannot_run(tiny_model):
    lm = engine_lm(tiny_model, slots=2)
    filled(lm, [5, 5])
    hidden, d = lm.config.hidden_size, lm.config.head_dim
    ok = {
        "h": torch.zeros(1, hidden),
        "cos": torch.ones(1, d),
        "sin": torch.zeros(1, d),
        "row_slots": torch.zeros(1, dtype=torch.long),
        "positions": torch.zeros(1, dtype=torch.long),
    }
    bad = {
        "h": torch.zeros(1, hidden, dtype=torch.float64),
        "cos": torch.ones(2, d),
        "sin": torch.zeros(1, 2 * d)[:, ::2],
        "row_slots": torch.zeros(1, dtype=torch.int32),
        "positions": torch.zeros(2, dtype=torch.long),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"^{name}:"):
            lm._decoder(**{**ok, name: value})
    max_len = next(iter(lm.decoder_layers)).attention.kv_cache.max_len
    with pytest.raises(ValueError, match="outside the KV cache"):
        lm._decoder(**{**ok, "positions": torch.tensor([max_len])})
    with pytest.raises(ValueError, match="outside the KV cache"):
        lm._decoder(**{**ok, "row_slots": torch.tensor([2])})
    layer = next(iter(lm.decoder_layers))
    layer.ffn_norm.weight = nn.Parameter(torch.ones(hidden + 1))
    with pytest.raises(ValueError, match="feed-forward norm"):
        lm._decoder(**ok)


def test_the_decoder_kernels_copy_and_pickle_as_their_path():
    import pickle

    for other in (copy.deepcopy(STATUS.decoder), pickle.loads(pickle.dumps(STATUS.decoder))):
        assert other.path == STATUS.decoder.path
        x, weight = rows(3, 896), torch.rand(896) + 0.5
        assert torch.equal(other.rms_norm(x, weight, 1e-6), STATUS.decoder.rms_norm(x, weight, 1e-6))
    with pytest.raises(ValueError, match="DecoderLayerRefs"):
        STATUS.decoder.bind([[({"weight": torch.ones(4)}, "weight")]], 2, 8, 1e-6)


def test_the_decoder_kernels_take_block_wise_float32_decoders_only(tiny_model):
    """The fast preset's LM takes them (and the engine says so); a per-channel INT8 LM or a
    bfloat16 one keeps PyTorch's operators and refuses them."""
    from mineru_fast.engine.generate import FastEngine

    per_channel = FastEngine(tiny_model, precision="fp32", slots=1, max_seq_len=256)
    assert "decoder layers" not in per_channel.decode_attention_reason and per_channel.lm._decoder_kernels is None
    with pytest.raises(ValueError, match="block-wise"):
        per_channel.lm.use_decoder_kernels(STATUS.decoder)
    bf16 = FastEngine(tiny_model, precision="bf16", slots=1, max_seq_len=256, **BLOCK)
    with pytest.raises(ValueError, match="float32"):
        bf16.lm.use_decoder_kernels(STATUS.decoder)
    assert engine_lm(tiny_model, slots=1)._decoder_kernels.path == STATUS.decoder.path
