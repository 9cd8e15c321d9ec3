"""PP-DocLayoutV2 models: the synthetic checkpoint and ONNX graph, both runtimes, batching,
replay, and locating the weights (with a clear error when they are missing)."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
from samples import text_page

from mineru_fast.errors import LayoutModelMissing, ModelLoadError, TraceError
from mineru_fast.layout import Detection, LayoutBlock, LayoutDetector, resolve_layout_weights
from mineru_fast.layout.detector import HUB_SOURCES
from mineru_fast.layout.inference import OnnxRunner, pixel_values
from mineru_fast.layout.synthetic import ARCHITECTURES
from mineru_fast.protocol.layout_trace import LayoutTrace

HAVE_EXPORT = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAVE_EXPORT, reason="needs onnx, onnxscript and onnxruntime (the dev extra)")


@pytest.fixture(scope="module")
def tiny_doclayout(tmp_path_factory):
    """A tiny synthetic PP-DocLayoutV2, the transformers checkpoint only (a second or two)."""
    from mineru_fast.layout.synthetic import make_synthetic_doclayout

    return make_synthetic_doclayout(tmp_path_factory.mktemp("doclayout") / "tiny", "tiny", seed=0, onnx=False)


@pytest.fixture(scope="module")
def tiny_doclayout_onnx(tmp_path_factory):
    """The same model in both forms: its ONNX export takes 30 s or more on 2 cores, so the tests
    that run the graph are in the slow lane."""
    from mineru_fast.layout.synthetic import make_synthetic_doclayout

    return make_synthetic_doclayout(tmp_path_factory.mktemp("doclayout") / "tiny", "tiny", seed=0, onnx=True)


@pytest.fixture(scope="module")
def pages():
    return [text_page(seed=0), text_page(size=(1200, 700), seed=1), text_page(seed=2)]


def comparable(layout) -> list[tuple]:
    """Detections sorted by position (a random model's reading order has ties)."""
    return sorted((d.label, d.bbox, d.score) for d in layout.detections)


def assert_same_detections(a, b, box_tol: float = 0.5, score_tol: float = 1e-4) -> None:
    # Different kernels (ONNX Runtime, torch; batch sizes) round float32 differently: boxes agree to
    # well under a pixel and scores to 1e-4, not bit for bit.
    a, b = comparable(a), comparable(b)
    assert [x[0] for x in a] == [x[0] for x in b]
    np.testing.assert_allclose([x[1] for x in a], [x[1] for x in b], atol=box_tol)
    np.testing.assert_allclose([x[2] for x in a], [x[2] for x in b], atol=score_tol)


def test_full_architecture_is_the_published_size():
    import torch
    from transformers import PPDocLayoutV2ForObjectDetection

    from mineru_fast.layout.synthetic import _config

    with torch.device("meta"):
        model = PPDocLayoutV2ForObjectDetection(_config("full"))
    # 53.6 M parameters, 214 MB in float32 (204.3 MiB): PaddleOCR lists the model at 203.8 MB.
    assert sum(p.numel() for p in model.parameters()) == 53_556_083
    assert ARCHITECTURES["full"]["num_queries"] == ARCHITECTURES["tiny"]["num_queries"] == 300


def test_synthetic_checkpoint_loads_in_transformers_and_detects(tiny_doclayout, pages):
    detector = LayoutDetector.from_pretrained(tiny_doclayout, backend="torch")
    assert detector.rules == "torch" and "synthetic (random weights, size=tiny, seed=0)" in detector.identity()
    layouts = detector.detect(pages)
    assert len(layouts) == 3 and all(layout.detections for layout in layouts)
    for layout, page in zip(layouts, pages, strict=True):
        assert layout.image_size == page.size
        assert all(0 <= v <= 1 for block in layout.blocks for v in block.bbox)


@pytest.mark.slow
@needs_onnx
def test_onnx_graph_has_the_published_signature(tiny_doclayout_onnx):
    import onnxruntime as ort

    session = ort.InferenceSession(str(tiny_doclayout_onnx / "inference.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    assert list(inputs) == ["im_shape", "image", "scale_factor"]
    assert inputs["image"].shape[1:] == [3, 800, 800] and isinstance(inputs["image"].shape[0], str)
    rows, counts = session.get_outputs()
    assert rows.shape[1] == 8 and rows.type == "tensor(float)" and counts.type == "tensor(int32)"


@pytest.mark.slow
@needs_onnx
def test_onnx_and_transformers_detect_the_same_regions(tiny_doclayout_onnx, pages):
    onnx = LayoutDetector.from_pretrained(tiny_doclayout_onnx, backend="onnx", threads=1)
    torch_ = LayoutDetector.from_pretrained(tiny_doclayout_onnx, backend="torch")
    assert onnx.weights.backend == "onnx" and onnx.rules == "onnx"
    for a, b in zip(onnx.detect(pages), torch_.detect(pages), strict=True):
        assert len(a.detections) > 0
        assert_same_detections(a, b)


@pytest.mark.slow
@needs_onnx
def test_batching_does_not_change_detections(tiny_doclayout_onnx, pages):
    one = LayoutDetector.from_pretrained(tiny_doclayout_onnx, backend="onnx", threads=1, batch_size=1)
    window = LayoutDetector.from_pretrained(tiny_doclayout_onnx, backend="onnx", threads=1, batch_size=2)
    for a, b in zip(one.detect(pages), window.detect(pages), strict=True):
        assert_same_detections(a, b)


def test_replay_runs_the_model_and_post_processes_the_trace(tiny_doclayout, pages):
    detector = LayoutDetector.from_pretrained(tiny_doclayout, backend="torch", batch_size=2)
    seen = []
    run = detector.runner.run

    def counting_run(pixels, sizes):
        seen.append(len(sizes))
        return run(pixels, sizes)

    detector.runner.run = counting_run
    replay = [
        [Detection("text", 0.9, (0.1, 0.1, 0.5, 0.2)), Detection("reference", 0.9, (0.1, 0.5, 0.5, 0.6))],
        [],
        [Detection("inline_formula", 0.8, (0.2, 0.2, 0.3, 0.25))],
    ]
    layouts = detector.detect(pages, replay=replay)
    assert seen == [2, 1]  # every page went through the model
    assert layouts[0].blocks == [LayoutBlock("text", (0.1, 0.1, 0.5, 0.2), score=0.9)]
    assert layouts[1].blocks == [] and layouts[1].detections == []
    # An inline formula inside no other block is a display formula: an equation block.
    assert layouts[2].blocks == [LayoutBlock("equation", (0.2, 0.2, 0.3, 0.25), score=0.8)]
    assert layouts[2].inline_formulas == []
    with pytest.raises(TraceError, match="2 pages for 3 images"):
        detector.detect(pages, replay=replay[:2])


def test_a_recorded_trace_replays_the_recorded_layout(tiny_doclayout, pages, tmp_path):
    detector = LayoutDetector.from_pretrained(tiny_doclayout, backend="torch")
    real = detector.detect(pages)
    LayoutTrace.from_layouts(real).save(tmp_path / "trace.json")
    from mineru_fast.protocol.layout_trace import load_layout_trace

    replayed = detector.detect(pages, replay=load_layout_trace(tmp_path / "trace.json").pages)
    for a, b in zip(real, replayed, strict=True):
        assert [blk.type for blk in a.blocks] == [blk.type for blk in b.blocks]
        # Boxes go through normalize -> scale -> floor/ceil: equal to 1 px (0.0015 of the page).
        np.testing.assert_allclose([blk.bbox for blk in a.blocks], [blk.bbox for blk in b.blocks], atol=0.0015)


@needs_onnx
def test_a_foreign_onnx_graph_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    path = tmp_path / "inference.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ModelLoadError, match="not PP-DocLayoutV2's graph"):
        OnnxRunner(path, threads=1)
    with pytest.raises(ModelLoadError, match="cannot load"):
        OnnxRunner(tmp_path, threads=1)


def test_pixel_values_resize_to_800_and_scale_to_unit():
    from PIL import Image

    values = pixel_values([Image.new("RGB", (1700, 2200), (255, 0, 51)), Image.new("L", (10, 10), 0)])
    assert values.shape == (2, 3, 800, 800) and values.dtype == np.float32
    assert np.allclose(values[0, :, 400, 400], [1.0, 0.0, 0.2]) and values[1].max() == 0.0


def test_missing_weights_say_what_to_download_and_where_they_were_looked_for(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LayoutModelMissing) as missing:
        resolve_layout_weights(download=False)
    message = str(missing.value)
    assert all(source.repo in message for source in HUB_SOURCES)
    assert str(tmp_path / "hub") in message and "hf download opendatalab/MinerU-4_models_onnx" in message
    assert isinstance(missing.value, ModelLoadError)
    with pytest.raises(LayoutModelMissing, match="holds no PP-DocLayoutV2"):
        resolve_layout_weights(tmp_path)
    with pytest.raises(LayoutModelMissing, match="no such layout model"):
        resolve_layout_weights(tmp_path / "nowhere" / "model.onnx")
    with pytest.raises(LayoutModelMissing):
        LayoutDetector.from_pretrained(download=False)


def test_weights_are_found_in_the_hugging_face_cache_and_in_repository_snapshots(tiny_doclayout, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # The cache layout huggingface_hub writes for opendatalab/MinerU-4_models_onnx.
    repo = tmp_path / "hub" / "models--opendatalab--MinerU-4_models_onnx"
    folder = repo / "snapshots" / "0123abcd" / "Layout" / "PP-DocLayoutV2"
    folder.mkdir(parents=True)
    # Locating reads names, not contents (loading the graph is OnnxRunner's, tested above).
    (folder / "inference.onnx").write_bytes(b"a graph's bytes")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    found = resolve_layout_weights(download=False)
    assert (found.backend, found.path) == ("onnx", folder / "inference.onnx")
    # A snapshot folder passed by path, and the checkpoint in a folder holding both forms.
    assert resolve_layout_weights(repo / "snapshots" / "0123abcd").path == folder / "inference.onnx"
    both = shutil.copytree(tiny_doclayout, tmp_path / "both")
    shutil.copy(folder / "inference.onnx", both / "inference.onnx")
    assert resolve_layout_weights(both, backend="torch").path == both
    assert resolve_layout_weights(both, backend="onnx").path == both / "inference.onnx"
    with pytest.raises(LayoutModelMissing, match=r"\(torch\)"):
        resolve_layout_weights(download=False, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        resolve_layout_weights(both, backend="paddle")


def test_the_synthetic_checkpoint_gets_the_mode_of_the_folders_other_files(tmp_path):
    from mineru_fast.layout.synthetic import make_synthetic_doclayout

    out = make_synthetic_doclayout(tmp_path / "tiny", "tiny", seed=0, onnx=False)
    (weights,) = out.glob("*.safetensors")
    assert weights.stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
