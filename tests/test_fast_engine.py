"""Tier 2: the fast engine against the transformers reference on the tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CORPUS, WORKLOAD
from PIL import Image
from samples import text_page

from mineru_fast.engine.base import GenerationRequest
from mineru_fast.engine.generate import FastEngine
from mineru_fast.engine.quantize import Int8DynamicConfig, Int8WeightOnlyConfig
from mineru_fast.engine.scheduler import SequenceState as _Sequence
from mineru_fast.inputs.documents import open_document
from mineru_fast.protocol.spec import LayoutBlock, crop_block, layout_image, prompt_for, sampling_for
from mineru_fast.protocol.spec import SamplingParams as SP

BOUND = 12  # tokens per request: enough to cover prompt, decode and the rules, cheap on CI


@pytest.fixture(scope="module")
def fast_engine(tiny_model):
    return FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)


def page_requests(page: Image.Image) -> list[GenerationRequest]:
    """The layout request of a page plus a text, a table and an equation crop of it."""
    requests = [GenerationRequest(layout_image(page), prompt_for("layout"), SP(max_new_tokens=BOUND))]
    for kind, box in [
        ("text", (0.1, 0.1, 0.9, 0.3)),
        ("table", (0.1, 0.4, 0.9, 0.7)),
        ("equation", (0.3, 0.8, 0.7, 0.85)),
    ]:
        crop = crop_block(page, LayoutBlock(kind, box))
        params = sampling_for(kind)
        requests.append(
            GenerationRequest(crop, prompt_for(kind), SP(params.presence_penalty, params.frequency_penalty, 100, BOUND))
        )
    return requests


def corpus_and_workload_pages() -> list:
    """Every page of the corpus and the workload as a parameter. A page of the same displayed size
    (in points, a turned page's swapped) as an earlier page of its document gives the engines
    images of the same shapes, so only its pixels are new: such pages run in the slow lane, every
    other page in the default lane."""
    pages = []
    if CORPUS.exists():
        for path in sorted(CORPUS.iterdir()):
            if path.suffix == ".md":
                continue
            password = "1234" if "password_required" in path.name else None
            seen = set()
            with open_document(path, password=password) as doc:
                for i in doc.page_indices:
                    shape = doc.page_points(i)
                    marks = [pytest.mark.slow] if shape in seen else []
                    seen.add(shape)
                    pages.append(pytest.param(str(path), i, marks=marks, id=f"{path.name}-p{i + 1}"))
    if WORKLOAD.exists():
        pages += [pytest.param(str(p), 0, id=f"{p.name}-p1") for p in sorted((WORKLOAD / "images").iterdir())]
    return pages


PAGES = corpus_and_workload_pages()


@pytest.mark.skipif(not PAGES, reason="../shared corpus and workload not present")
@pytest.mark.parametrize(("path", "index"), PAGES or [pytest.param("", 0, id="none")])
def test_fast_fp32_gives_reference_tokens_on_every_corpus_and_workload_page(fast_engine, reference_engine, path, index):
    """One test per page: each stays far from the per-test timeout however loaded the machine is."""
    with open_document(path, password="1234" if "password_required" in path else None) as doc:
        requests = page_requests(doc.render(index))
    fast = fast_engine.generate(requests)  # layout + 3 crops decode together
    reference = reference_engine.generate(requests)  # one at a time
    mismatches = []
    for r, (f, ref) in enumerate(zip(fast, reference, strict=True)):
        assert f.finish_reason != "error", f.error
        if f.token_ids != ref.token_ids:
            mismatches.append((r, f.token_ids, ref.token_ids))
    assert mismatches == []


def test_fast_logits_match_reference(fast_engine, reference_engine):
    """Prefill and 6 decode steps (forced tokens) against transformers' forward.

    Tolerance: 1e-3 absolute on logits of magnitude ~40. The two implementations sum in different
    orders (fused q/k/v and gate/up matmuls, our own norm and rotary code), which in float32 moves
    logits by ~1e-5; anything structural (positions, masks, weights) moves them by units.
    """
    request = GenerationRequest(text_page().crop((40, 40, 700, 300)), prompt_for("text"), SP())
    seq = _Sequence(0, request, fast_engine.preprocessor.encode(request))
    fast_engine.encode_images([seq])
    inputs = reference_engine.encode(request)
    forced = [100, 2000, 151648, 15, 151649, 500]
    ids = inputs["input_ids"]
    prompt_len = ids.shape[1]
    with torch.inference_mode():
        fast_logits = [fast_engine.prefill(seq, slot=1)]
        for step, token in enumerate(forced):
            tokens = torch.tensor([0, token])
            rope = torch.tensor([0, seq.rope_next + step])
            cache = torch.tensor([0, prompt_len + step])
            fast_logits.append(fast_engine.lm.decode(tokens, rope, cache)[1])
        full = torch.cat([ids, torch.tensor([forced])], dim=1)
        reference = reference_engine.model(
            input_ids=full,
            attention_mask=torch.ones_like(full),
            mm_token_type_ids=(full == fast_engine.preprocessor.image_token_id).to(torch.int32),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        ).logits[0, prompt_len - 1 :]
    assert reference.abs().max() > 10  # logits are not trivially small
    for step, logits in enumerate(fast_logits):
        assert torch.allclose(logits, reference[step], atol=1e-3, rtol=0), step


def test_each_decode_row_attends_to_its_own_length_only(fast_engine):
    """A decode step over slots of different lengths: each row's logits equal the same token fed
    to its slot alone through the prefill path (a one-token chunk at that position, masked causal
    attention over the cache). The slots first held a longer sequence, so a row that read past its
    own length would attend to stale keys.

    Tolerance: 1e-3 absolute on logits of magnitude ~10-40, as in the reference comparison above
    (same math, different kernels and batch shapes: ~1e-5); stale keys move them by units.
    """
    lm = fast_engine.lm
    g = torch.Generator().manual_seed(0)
    lengths = [5, 40, 17, 29]
    tokens = torch.randint(0, lm.config.vocab_size, (4,), generator=g)
    with torch.inference_mode():
        for slot in range(4):
            stale = lm.embed_tokens(torch.randint(0, lm.config.vocab_size, (60,), generator=g))
            lm.prefill_chunks([(stale, torch.arange(60).expand(3, -1), slot, 0)])
        for slot, n in enumerate(lengths):
            prompt = lm.embed_tokens(torch.randint(0, lm.config.vocab_size, (n,), generator=g))
            lm.prefill_chunks([(prompt, torch.arange(n).expand(3, -1), slot, 0)])
        positions = torch.tensor(lengths)
        batched = lm.decode(tokens, positions, positions)
        for slot, n in enumerate(lengths):
            chunk = (lm.embed_tokens(tokens[slot : slot + 1]), torch.full((3, 1), n), slot, n)
            alone = lm.prefill_chunks([chunk])[0]
            assert alone.abs().max() > 5
            assert torch.allclose(batched[slot], alone, atol=1e-3, rtol=0), (slot, (batched[slot] - alone).abs().max())


def test_batched_decoding_equals_one_at_a_time(tiny_model, fast_engine):
    requests = page_requests(text_page()) + page_requests(text_page(seed=3))
    batched = fast_engine.generate(requests)
    single = FastEngine(tiny_model, precision="fp32", slots=1, max_seq_len=2048)
    one_by_one = [single.generate([r])[0] for r in requests]
    assert [r.token_ids for r in batched] == [r.token_ids for r in one_by_one]


def test_replay_forces_exact_output_and_kv_buffers_stay_put(fast_engine):
    buffers = [
        (layer.attention.kv_cache.k.data_ptr(), layer.attention.kv_cache.v.data_ptr())
        for layer in fast_engine.lm.layers
    ]
    text = "<|box_start|>010 020 500 080<|box_end|><|ref_start|>title<|ref_end|><|rotate_up|>\n表 1 <fcel>x<nl>"
    page = text_page()
    requests = [
        GenerationRequest(layout_image(page), prompt_for("layout"), SP(max_new_tokens=100), forced_text=text),
        GenerationRequest(page.crop((0, 0, 300, 200)), prompt_for("text"), SP(max_new_tokens=BOUND)),
        GenerationRequest(page.crop((0, 0, 300, 200)), prompt_for("text"), SP(max_new_tokens=5), forced_text=text),
    ]
    forced, free, cut = fast_engine.generate(requests)
    assert forced.text == text and forced.finish_reason == "stop"
    assert free.finish_reason in ("stop", "length") and 0 < len(free.token_ids) <= BOUND
    assert cut.finish_reason == "length" and cut.token_ids == fast_engine.preprocessor.forced_ids(text)[:5]
    assert [
        (layer.attention.kv_cache.k.data_ptr(), layer.attention.kv_cache.v.data_ptr())
        for layer in fast_engine.lm.layers
    ] == buffers


def test_a_released_kv_slot_is_zero_and_uncommitted_and_its_neighbours_keep_theirs():
    """``KVCache.release`` hands a slot's pages back: its positions read as zeros, the resident
    size of the buffers falls by the slot's pages, and the slots beside it keep their values, also
    where a slot's size is not a whole number of pages (the pages it shares are kept)."""
    import mmap

    from mineru_fast.engine.kv_cache import KVCache
    from mineru_fast.engine.memory import resident_bytes

    for max_len in (1024, 1001):  # 1024: each slot is whole pages; 1001 (512,512 bytes): slots share pages
        cache = KVCache(slots=3, kv_heads=2, max_len=max_len, head_dim=64, dtype=torch.float32)
        values = torch.randn(1, 2, max_len, 64)
        for slot in range(3):
            cache.write_prefill(slot, values + slot, values - slot)
        before = resident_bytes([cache.k, cache.v])
        cache.release(1)
        assert before is not None and before - resident_bytes([cache.k, cache.v]) >= 2 * (
            2 * max_len * 64 * 4 - 2 * mmap.PAGESIZE
        )
        whole_pages = slice(mmap.PAGESIZE // 256, max_len - mmap.PAGESIZE // 256)  # 256 bytes per position
        assert not cache.k[1, :, whole_pages].any() and not cache.v[1, :, whole_pages].any()
        for slot in (0, 2):
            assert torch.equal(cache.k[slot], values[0] + slot) and torch.equal(cache.v[slot], values[0] - slot)


def test_a_kernel_that_refuses_to_release_kv_slots_only_leaves_them_committed(monkeypatch, caplog):
    """Where ``madvise(MADV_REMOVE)`` is refused (a sandboxed kernel), ``release`` logs it once and
    stops trying: the slot keeps its values and nothing raises into the engine loop."""
    import logging

    from mineru_fast.engine import kv_cache

    class Refusing:
        calls = 0

        def madvise(self, *args: object) -> None:
            Refusing.calls += 1
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(kv_cache, "_release_refused", False)
    cache = kv_cache.KVCache(slots=2, kv_heads=2, max_len=1024, head_dim=64, dtype=torch.float32)
    cache.write_prefill(1, torch.ones(1, 2, 1024, 64), torch.ones(1, 2, 1024, 64))
    real = cache._k_region
    cache._k_region = Refusing()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="mineru_fast.engine.kv_cache"):
        cache.release(1)
        cache.release(1)
    cache._k_region = real
    assert Refusing.calls == 1 and kv_cache._release_refused
    assert sum("not released" in r.getMessage() for r in caplog.records) == 1
    assert cache.k[1].eq(1).all()


def test_finished_sequences_give_their_kv_memory_back(tiny_model):
    """Every slot a finished (or moved) sequence leaves is released, so after a batch the KV buffers
    hold at most the one page per slot and layer a padding row writes, not the longest sequence each
    slot ever held; the tokens are those of a run without releases."""
    import mmap

    from mineru_fast.engine.memory import resident_bytes

    engine = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    requests = page_requests(text_page()) + page_requests(text_page(seed=3))
    results = engine.generate(requests)
    buffers = [t for layer in engine.lm.layers for t in (layer.attention.kv_cache.k, layer.attention.kv_cache.v)]
    kv_heads = engine.lm.layers[0].attention.kv_cache.k.shape[1]
    committed = resident_bytes(buffers)
    assert committed is not None and committed <= len(buffers) * 4 * kv_heads * mmap.PAGESIZE
    kept = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    kept.lm.release_slot = lambda slot: None  # type: ignore[method-assign]
    assert [r.token_ids for r in kept.generate(requests)] == [r.token_ids for r in results]
    engine.close()
    kept.close()


def test_follow_ups_join_the_running_batch(tiny_model):
    """A request submitted while others decode joins their batch: the short layout's follow-up
    crop finishes before the long layout still decoding, with the tokens it gets alone. The loop
    is stepped by hand, so the interleaving does not depend on thread timing."""
    engine = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    page = text_page()
    numbers = " ".join(str(i) for i in range(100))  # ~200 tokens, cut at 40
    long_layout = GenerationRequest(
        layout_image(page), prompt_for("layout"), SP(max_new_tokens=40), forced_text=numbers
    )
    short_layout = GenerationRequest(layout_image(page), prompt_for("layout"), SP(max_new_tokens=40), forced_text="y")
    crop = page_requests(page)[1]
    scheduler = engine.scheduler
    long_handle, short_handle = (scheduler.submit(r, start=False) for r in (long_layout, short_layout))
    while not short_handle.done():
        scheduler.step()
    assert not long_handle.done() and short_handle.result().text == "y"
    crop_handle = scheduler.submit(crop, start=False)
    while not crop_handle.done():
        scheduler.step()
    assert not long_handle.done()
    while scheduler.has_work():
        scheduler.step()
    assert len(long_handle.result().token_ids) == 40
    (alone,) = FastEngine(tiny_model, precision="fp32", slots=1, max_seq_len=2048).generate([crop])
    assert crop_handle.result().token_ids == alone.token_ids


def test_bf16_kv_buffers_stay_close_to_fp32(tiny_model, fast_engine):
    """Decode-step logits with bfloat16 KV buffers versus float32 ones, over 8 steps of 4 requests.

    Keys and values rounded to bfloat16 (8 mantissa bits, ~0.4% relative error) perturb the
    attention output by well under 1%, so logits keep a cosine above 0.999 and the same argmax.
    """
    half = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048, kv_dtype=torch.bfloat16)
    assert half.lm.layers[0].attention.kv_cache.k.dtype == torch.bfloat16
    requests = page_requests(text_page(seed=5))
    steps = []
    for engine in (fast_engine, half):
        sequences = [_Sequence(i, r, engine.preprocessor.encode(r)) for i, r in enumerate(requests)]
        engine.encode_images(sequences)
        with torch.inference_mode():
            for slot, seq in enumerate(sequences):
                engine.prefill(seq, slot)
            lengths = torch.tensor([len(s.encoded.input_ids) for s in sequences])
            rope = torch.tensor([s.rope_next for s in sequences])
            logits = []
            for step in range(8):
                tokens = torch.full((4,), 100 + step)
                logits.append(engine.lm.decode(tokens, rope + step, lengths + step))
        steps.append(torch.cat(logits))
    cosine = F.cosine_similarity(steps[1], steps[0], dim=-1)
    assert cosine.min() > 0.999
    assert torch.equal(steps[1].argmax(-1), steps[0].argmax(-1))


def test_bad_request_fails_alone(fast_engine):
    good = GenerationRequest(text_page().crop((0, 0, 400, 100)), prompt_for("text"), SP(max_new_tokens=4))
    bad = GenerationRequest(Image.new("RGB", (2, 600)), prompt_for("text"), SP(max_new_tokens=4))
    results = fast_engine.generate([good, bad, good])
    assert [r.finish_reason == "error" for r in results] == [False, True, False]
    assert results[0].token_ids == results[2].token_ids


# compile: torch.compile's first call (~9 s of Inductor code generation) in the slow lane
@pytest.mark.parametrize("mode", ["trace", pytest.param("compile", marks=pytest.mark.slow)])
def test_traced_and_compiled_vision_match_eager(fast_engine, mode):
    from mineru_fast.engine.vision_runner import make_vision_runner

    requests = page_requests(text_page())[:2]
    encoded = [fast_engine.preprocessor.encode(r) for r in requests]
    pixels = torch.cat([e.pixel_values for e in encoded])
    grids = [e.grid_thw for e in encoded]
    with torch.inference_mode():
        eager = fast_engine.vision(pixels, grids)
    runner = make_vision_runner(fast_engine.vision, mode)
    with torch.no_grad():
        other = runner(pixels, grids)
        again = runner(pixels, grids)  # second call hits the cache
    # Same float32 math; fusion and op order move values by ~1e-6 of their scale.
    assert torch.allclose(other, eager, atol=1e-4, rtol=1e-4)
    assert torch.equal(other, again)


def logits_of(engine: FastEngine, requests: list[GenerationRequest]) -> torch.Tensor:
    sequences = [_Sequence(i, r, engine.preprocessor.encode(r)) for i, r in enumerate(requests)]
    engine.encode_images(sequences)
    with torch.inference_mode():
        return torch.stack([engine.prefill(s, slot=0) for s in sequences])


@pytest.mark.parametrize(
    ("precision", "quant", "min_cosine", "min_top1"),
    [
        ("bf16", None, 0.99, 0.75),
        ("fp32", Int8DynamicConfig(backend="int_mm"), 0.99, 0.75),
        ("fp32", Int8DynamicConfig(backend="torch_ao"), 0.99, 0.75),
        ("fp32", Int8WeightOnlyConfig(), 0.999, 0.9),
    ],
    ids=["bf16", "int8-dynamic-int_mm", "int8-dynamic-torch_ao", "int8-weight-only"],
)
def test_reduced_precision_stays_close_to_fp32(tiny_model, fast_engine, precision, quant, min_cosine, min_top1):
    """Cosine similarity and top-1 agreement of first-token logits versus fp32, over 16 requests.

    Thresholds: bf16 keeps 8 mantissa bits and dynamic INT8 quantizes activations per token to
    7 bits, each a relative error of ~0.5-1% per matmul, which leaves logits cosine > 0.99; top-1
    can flip where the random model's two best logits are close, so 75% is required. Weight-only
    INT8 keeps float activations and must stay closer.
    """
    requests = page_requests(text_page()) + page_requests(text_page(seed=1)) + page_requests(text_page(seed=2))
    requests += page_requests(text_page(seed=3))
    reference = logits_of(fast_engine, requests)
    engine = FastEngine(
        tiny_model,
        precision=precision,
        slots=1,
        max_seq_len=2048,
        vision_quant=quant,
        lm_quant=quant,
        lm_head_quant=quant,
    )
    logits = logits_of(engine, requests)
    cosine = F.cosine_similarity(logits, reference, dim=-1)
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    print(f"{precision}/{quant}: min cosine {cosine.min():.5f}, top-1 agreement {top1:.3f}")
    assert cosine.min() >= min_cosine and top1 >= min_top1


def test_bf16_weight_storage_is_bit_exact_for_a_bf16_checkpoint(tiny_model, fast_engine):
    """The exact preset's storage (every linear and the embedding in the checkpoint's bfloat16,
    upcast per call) gives bit-identical vision outputs and logits to float32 weights."""
    from mineru_fast.engine.quantize import Bf16WeightsConfig

    bf16 = Bf16WeightsConfig()
    stored = FastEngine(
        tiny_model, precision="fp32", slots=1, max_seq_len=2048, vision_quant=bf16, lm_quant=bf16, lm_head_quant=bf16
    )
    requests = page_requests(text_page())
    encoded = fast_engine.preprocessor.encode(requests[1])
    with torch.inference_mode():
        expected = fast_engine.vision(encoded.pixel_values, [encoded.grid_thw])
        got = stored.vision(encoded.pixel_values, [encoded.grid_thw])
    assert torch.equal(got, expected)
    assert torch.equal(logits_of(stored, requests), logits_of(fast_engine, requests))
    weights = [m.weight_bf16 for m in stored.vision.modules() if hasattr(m, "weight_bf16")]
    weights += [m.weight_bf16 for m in stored.lm.modules() if hasattr(m, "weight_bf16")]
    assert weights and all(w.dtype == torch.bfloat16 for w in weights)
    assert stored.lm.embed.weight.dtype == torch.bfloat16


def test_vision_attention_gives_the_same_values_whatever_the_head_grouping(monkeypatch):
    """Heads attend independently, so running them in groups (``ATTENTION_HEAD_GROUP``, for memory)
    must not change a value: compared bit for bit with all heads in one call."""
    from mineru_fast.engine import vision

    torch.manual_seed(0)
    block = vision.VisionBlock(
        vision.VisionConfig(depth=1, embed_dim=256, num_heads=8, mlp_ratio=4, out_hidden_size=64)
    )
    x, cos, sin = torch.randn(300, 256), torch.randn(1, 300, 32), torch.randn(1, 300, 32)
    monkeypatch.setattr(vision, "ATTENTION_HEAD_GROUP", 8)
    with torch.inference_mode():
        whole = block.attention(x.clone(), cos, sin)  # the input is consumed (its storage reused)
        for group in (1, 3, 4):
            monkeypatch.setattr(vision, "ATTENTION_HEAD_GROUP", group)
            assert torch.equal(block.attention(x.clone(), cos, sin), whole)
        # Against the textbook form (every head at once, fresh tensors): the same operators on the
        # same values, so equal up to SDPA's blocking over heads (1e-6).
        q, k, v = block.qkv(x).view(300, 3, 8, 32).permute(1, 2, 0, 3)
        q, k = vision.apply_rotary(q, cos, sin), vision.apply_rotary(k, cos, sin)
        heads = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        textbook = block.proj(heads.transpose(0, 1).reshape(300, 256))
    torch.testing.assert_close(whole, textbook, rtol=1e-6, atol=1e-6)


def test_vision_attention_with_qkv_packed_by_head_group_gives_the_same_values(monkeypatch):
    """The fast preset packs each block's INT8 ``qkv`` by head group, so attention computes one
    group's queries, keys and values at a time and never the whole ``[n, 3 * dim]``: the same values
    bit for bit as the one-pack layer, and the layer's whole-output path is not taken."""
    from mineru_fast.engine import vision
    from mineru_fast.engine.quantize import OneDnnInt8Linear

    torch.manual_seed(0)
    config = vision.VisionConfig(depth=1, embed_dim=256, num_heads=8, mlp_ratio=4, out_hidden_size=64)
    block = vision.VisionBlock(config)
    block.qkv, block.proj = OneDnnInt8Linear(block.qkv), OneDnnInt8Linear(block.proj)
    x, cos, sin = torch.randn(300, 256), torch.randn(1, 300, 32), torch.randn(1, 300, 32)
    with torch.inference_mode():
        whole = block.attention(x.clone(), cos, sin)
        vision.pack_qkv_by_head_group(block.qkv, config)
        assert block.qkv.row_groups is not None and block.qkv.row_groups.shape == (4, 3 * 2 * 32)

        def no_whole_output(x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("qkv computed whole")

        monkeypatch.setattr(block.qkv, "forward", no_whole_output)
        assert torch.equal(block.attention(x.clone(), cos, sin), whole)
    with pytest.raises(ValueError, match="groups of 2"):
        vision.qkv_row_groups(vision.VisionConfig(depth=1, embed_dim=96, num_heads=3, mlp_ratio=4, out_hidden_size=8))


def test_vision_mlp_gives_the_same_values_whatever_the_chunk_rows(monkeypatch):
    """The MLP is row-wise, so ``MLP_CHUNK_ROWS`` (chosen for the mmap threshold) changes no value
    of the fast preset's per-token INT8 linears (each row's integers and scales are its own): bit
    for bit against one chunk over all rows. Float32 linears agree to rounding (1e-5): the GEMM's
    blocking, hence its summation order, depends on the number of rows."""
    from mineru_fast.engine import vision
    from mineru_fast.engine.quantize import OneDnnInt8Linear

    torch.manual_seed(0)
    block = vision.VisionBlock(
        vision.VisionConfig(depth=1, embed_dim=256, num_heads=8, mlp_ratio=4, out_hidden_size=64)
    )
    x, cos, sin = torch.randn(300, 256), torch.randn(1, 300, 32), torch.randn(1, 300, 32)

    def outputs() -> list[torch.Tensor]:
        out = []
        for rows in (300, 1, 7, 192):
            monkeypatch.setattr(vision, "MLP_CHUNK_ROWS", rows)
            out.append(block(x.clone(), cos, sin, [300]))
        return out

    with torch.inference_mode():
        whole, *chunked = outputs()
        for y in chunked:
            torch.testing.assert_close(y, whole, rtol=1e-5, atol=1e-5)
        block.fc1, block.fc2 = OneDnnInt8Linear(block.fc1), OneDnnInt8Linear(block.fc2)
        whole, *chunked = outputs()
        assert all(torch.equal(y, whole) for y in chunked)


def test_vision_rotary_cache_keeps_the_most_recent_grids(monkeypatch):
    """The rotary tables are cached per grid, but only the ``ROPE_CACHE_GRIDS`` most recently used
    (crop grids vary with every block size: an unbounded cache grew over a server's life). The
    layout grid, used on every page, stays; an evicted grid's tables are rebuilt equal."""
    from mineru_fast.engine import vision

    monkeypatch.setattr(vision, "ROPE_CACHE_GRIDS", 4)
    encoder = vision.VisionEncoder(
        vision.VisionConfig(depth=1, embed_dim=64, num_heads=2, mlp_ratio=2, out_hidden_size=32)
    )
    layout, first = (1, 8, 8), (1, 2, 2)
    first_tables = encoder.rotary(first)
    for w in range(4, 24, 2):
        encoder.rotary(layout)  # every page
        encoder.rotary((1, 2, w))  # a new crop size
    assert len(encoder._rope_cache) == 4
    assert layout in encoder._rope_cache and first not in encoder._rope_cache
    again = encoder.rotary(first)
    assert all(torch.equal(a, b) for a, b in zip(again, first_tables, strict=True))


@pytest.mark.parametrize("rows", [1, 3, 700])
def test_rms_norm_on_float32_is_the_operator_form_bit_for_bit(rows):
    """``RMSNorm`` runs ``torch.rms_norm`` on float32: the same bits as transformers' operators one by one."""
    from mineru_fast.engine.model import RMSNorm

    generator = torch.Generator().manual_seed(rows)
    norm = RMSNorm(896, 1e-6)
    norm.weight.data = torch.randn(896, generator=generator)
    x = torch.randn(rows, 1, 896, generator=generator) * 5
    with torch.inference_mode():
        by_operators = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.equal(norm(x), by_operators)
        # bfloat16 keeps the operators (F.rms_norm rounds otherwise there)
        xb, nb = x.bfloat16(), norm.bfloat16()
        wide = xb.float()
        expected = nb.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        assert torch.equal(nb(xb), expected)


def test_lm_mlp_gives_the_same_values_whatever_the_chunk_rows(monkeypatch):
    """On the fast preset's block INT8 linears a prefill's MLP runs ``model.MLP_CHUNK_ROWS`` rows at
    a time (its ``w_gate_up`` output then stays under the mmap threshold): each row's MLP is its
    own and the block kernel's arithmetic does not depend on the row count, so bit for bit against
    one call over all rows, for chunk sizes that divide the rows and ones that leave a remainder.
    Float linears run the rows in one call."""
    from mineru_fast.engine import model
    from mineru_fast.engine.quantize import BlockInt8Linear

    torch.manual_seed(0)
    config = model.TextConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=160,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        mrope_section=(2, 3, 3),
        tie_word_embeddings=True,
    )
    mlp = model.FeedForward(config)
    x = torch.randn(1, 300, 64)
    with torch.inference_mode():
        # float linears run the rows whole: a GEMM may round otherwise at another row count
        monkeypatch.setattr(model, "MLP_CHUNK_ROWS", 7)
        rows_per_call = []
        whole_rows = mlp._rows
        monkeypatch.setattr(mlp, "_rows", lambda h: rows_per_call.append(h.numel() // 64) or whole_rows(h))
        mlp(x)
        assert rows_per_call == [300]
        monkeypatch.undo()
        mlp.w_gate_up, mlp.w_down = BlockInt8Linear(mlp.w_gate_up), BlockInt8Linear(mlp.w_down)
        outputs = []
        for rows in (300, 1, 7, 96, 100):
            monkeypatch.setattr(model, "MLP_CHUNK_ROWS", rows)
            outputs.append(mlp(x))
    whole, *chunked = outputs
    assert whole.shape == x.shape
    assert all(torch.equal(y, whole) for y in chunked)


def test_stage_seconds_account_for_a_batch(tiny_model):
    """``FastEngine.stage_seconds``: every stage of a batch of requests is counted (vision split
    into linears, attention and the rest; prefill; decode forward and the rest of its steps), none
    negative, and together they fit in the wall time between the two calls (the loop's wait for
    work in progress at a call counts as idle up to it)."""
    import time

    engine = FastEngine(tiny_model, precision="fp32", slots=4, max_seq_len=2048)
    try:
        engine.generate(page_requests(text_page())[:1])  # the loop has started and is waiting
        start = time.perf_counter()
        before = engine.stage_seconds()
        results = engine.generate(page_requests(text_page()))
        after = engine.stage_seconds()
        wall = time.perf_counter() - start
    finally:
        engine.close()
    assert all(r.finish_reason != "error" for r in results)
    spent = {stage: after[stage] - before[stage] for stage in after}
    assert set(spent) == {
        "vision_linears",
        "vision_attention",
        "vision_other",
        "prefill",
        "decode_forward",
        "decode_other",
        "idle",
    }
    worked = ("vision_linears", "vision_attention", "prefill", "decode_forward", "decode_other")
    assert all(spent[stage] > 0 for stage in worked)
    assert all(seconds >= 0 for seconds in spent.values())
    # within the wall time, but for the first batch's last decode step, whose rest (after its
    # results were out, under a millisecond) may come after the first reading
    assert sum(spent.values()) <= wall + 0.05
