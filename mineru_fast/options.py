"""``ParserOptions``: every knob of a ``DocumentParser`` in one validated object."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .inputs import DEFAULT_DPI, DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE
from .protocol import LAYOUT_TASK, SamplingParams, sampling_for

ENGINES = ("reference",)
PRECISIONS = ("fp32", "bf16")
TASKS = (LAYOUT_TASK, "text", "table", "equation")

__all__ = ["ParserOptions", "PRESETS"]


@dataclass(frozen=True)
class ParserOptions:
    """Options of a ``DocumentParser``; invalid values raise ``ValueError`` at construction.

    Attributes:
        engine: inference engine; ``"reference"`` is transformers' ``generate`` at batch 1.
        precision: ``"bf16"`` (the checkpoint's dtype) or ``"fp32"``.
        threads: intra-op threads for torch; None keeps torch's default (physical cores).
        dpi: PDF render resolution.
        max_side: longest page side in pixels after rendering or loading.
        max_image_pixels: inputs above this many pixels are refused (decompression-bomb guard).
        max_new_tokens: per-task bound on generated tokens, overriding the defaults of
            ``protocol.SAMPLING``; keys ``"layout"``, ``"text"``, ``"table"``, ``"equation"``.
        progress: show a tqdm progress bar over pages.
    """

    engine: str = "reference"
    precision: str = "bf16"
    threads: int | None = None
    dpi: int = DEFAULT_DPI
    max_side: int = DEFAULT_MAX_SIDE
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_new_tokens: dict[str, int] = field(default_factory=dict)
    progress: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in ("dpi", "max_side", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for task, bound in self.max_new_tokens.items():
            if task not in TASKS:
                raise ValueError(f"max_new_tokens keys must be in {TASKS}, got {task!r}")
            if bound < 1:
                raise ValueError(f"max_new_tokens[{task!r}] must be >= 1, got {bound}")

    def sampling(self, task: str) -> SamplingParams:
        """Sampling parameters of a task (``"layout"`` or a block type), bounds applied."""
        params = sampling_for(task)
        key = task if task in TASKS else "text"
        if key in self.max_new_tokens:
            params = replace(params, max_new_tokens=self.max_new_tokens[key])
        return params

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ParserOptions:
        """Named starting points (see ``PRESETS``), with field overrides.

        Raises:
            ValueError: unknown preset name or invalid override.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS: dict[str, ParserOptions] = {
    # transformers in fp32: the numerically exact baseline.
    "exact": ParserOptions(engine="reference", precision="fp32"),
    # transformers in bf16, as the official client runs it on CPU.
    "reference": ParserOptions(engine="reference", precision="bf16"),
}
