"""PP-DocLayoutV2, the layout model of MinerU 4's ``standard`` tier.

>>> from mineru_fast.layout import LayoutDetector
>>> detector = LayoutDetector.from_pretrained()  # ONNX or transformers weights, local or hub
>>> layouts = detector.detect(page_images)         # one PageLayout per image, blocks in reading order

Modules: ``labels`` (the model's classes and MinerU's use of them), ``postprocess`` (MinerU 4's
post-processing, pure), ``inference`` (ONNX Runtime and transformers runners), ``detector``
(locating and running the weights), ``synthetic`` (random-weight models of the exact
architecture). Replaying recorded detections instead of running the model is
``protocol.layout_trace``.
"""

from mineru_fast.layout.detector import LayoutDetector, LayoutWeights, resolve_layout_weights
from mineru_fast.layout.labels import BLOCK_TYPE_BY_LABEL, LABELS
from mineru_fast.layout.postprocess import Detection, LayoutBlock, PageLayout, postprocess, select_rows, to_page_layout

__all__ = [
    "LayoutDetector",
    "LayoutWeights",
    "resolve_layout_weights",
    "LABELS",
    "BLOCK_TYPE_BY_LABEL",
    "Detection",
    "LayoutBlock",
    "PageLayout",
    "postprocess",
    "select_rows",
    "to_page_layout",
]
