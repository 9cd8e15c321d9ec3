"""PP-DocLayoutV2, the layout model of MinerU 4's ``standard`` tier.

>>> from mineru_fast.doclayout import LayoutDetector
>>> detector = LayoutDetector.from_pretrained()  # ONNX or transformers weights, local or hub
>>> layouts = detector.detect(page_images)         # one PageLayout per image, blocks in reading order

Modules: ``labels`` (the model's classes and MinerU's use of them), ``postprocess`` (MinerU 4's
post-processing, pure), ``inference`` (ONNX Runtime and transformers runners), ``detector``
(locating and running the weights), ``trace`` (replay of detections), ``synthetic``
(random-weight models of the exact architecture).
"""

from .detector import LayoutDetector, LayoutWeights, resolve_layout_weights
from .labels import BLOCK_TYPE_BY_LABEL, LABELS
from .postprocess import Detection, LayoutBlock, PageLayout, postprocess, select_rows, to_page_layout
from .trace import LayoutTrace, detections_from_blocks, load_layout_trace

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
    "LayoutTrace",
    "load_layout_trace",
    "detections_from_blocks",
]
