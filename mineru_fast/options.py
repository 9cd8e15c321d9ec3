"""``ParserOptions``: every knob of a ``DocumentParser`` in one validated object, with presets."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from mineru_fast.inputs.documents import DEFAULT_DPI, DEFAULT_MAX_PAGES, DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE
from mineru_fast.protocol.spec import LAYOUT_TASK, MODEL_VERSIONS, SamplingParams, sampling_for
from mineru_fast.runtime.choice import CANDIDATES, choose_preset

ENGINES = ("fast", "reference")
PRECISIONS = ("fp32", "bf16")
KV_DTYPES = ("auto", "fp32", "bf16")
QUANTIZATIONS = ("none", "int8-dynamic", "int8-block", "int8-weight-only", "bf16-weights")
VISION_MODES = ("eager", "trace", "compile")
VISION_ATTENTIONS = ("bf16", "fp32")
BACKENDS = ("stock", "ipex", "auto")
INT8_KERNELS = ("auto", "onednn", "int_mm", "torch_ao")  # see engine/quantize.py
TASKS = (LAYOUT_TASK, "text", "table", "equation")
TIERS = ("standard", "advanced")  # MinerU 4's names (effort "high" and "xhigh"); see README "Tiers"
OCR_MODES = ("auto", "txt", "ocr")  # as pdftext.OCR_MODES
LAYOUT_BACKENDS = ("auto", "onnx", "torch")  # as layout.detector.BACKENDS
# Most draft tokens per request and decode step. A step holds at most 8 rows (the scheduler's
# speculative_rows), so larger values never verify more; the bound refuses a value in another unit.
MAX_SPECULATIVE = 32


def check_speculative(value: object) -> int:
    """A ``speculative`` bound (``ParserOptions.speculative``, ``GenerationRequest.speculative``)
    as an ``int`` from 0 to ``MAX_SPECULATIVE``: an integer of any integer type (``numpy.int64``
    too), never a ``bool``, ``float`` or string.

    Raises:
        ValueError: not an integer, or outside 0..``MAX_SPECULATIVE``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"speculative must be an integer (draft tokens, 0 = off), got {value!r}") from None
    if not 0 <= count <= MAX_SPECULATIVE:
        raise ValueError(f"speculative must be 0 (off) to {MAX_SPECULATIVE} draft tokens, got {count}")
    return count


__all__ = ["ParserOptions", "PRESETS", "TokenBounds"]


class TokenBounds(Mapping[str, int]):
    """An immutable, hashable ``{task: max_new_tokens}`` mapping (``ParserOptions.max_new_tokens``).

    Compares equal to a ``dict`` with the same items; iterates in sorted key order.
    """

    def __init__(self, bounds: Mapping[str, int] | None = None) -> None:
        self._items = tuple(sorted((bounds or {}).items()))

    def __getitem__(self, key: str) -> int:
        for name, value in self._items:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return f"TokenBounds({dict(self._items)!r})"


@dataclass(frozen=True)
class ParserOptions:
    """Options of a ``DocumentParser``; invalid values raise ``ValueError`` at construction.

    Attributes:
        engine: ``"fast"`` (this package's own model code, batched) or ``"reference"``
            (transformers ``generate`` at batch 1, as the official client runs it).
        precision: float dtype of weights and activations, ``"fp32"`` or ``"bf16"``.
        vision_quant / lm_quant / lm_head_quant: ``"none"``, ``"int8-dynamic"`` (int8 weights per
            output channel, activations per token or per tensor: ``int8_kernel``),
            ``"int8-block"`` (int8 weights and activations with one scale per 32 consecutive
            input values, llama.cpp's Q8_0 granularity, on the own kernel: the same arithmetic on
            every CPU, its instruction-set path in ``engine.numerics``' ``lm_int8_block``),
            ``"int8-weight-only"`` or ``"bf16-weights"`` (bfloat16 storage, upcast per call:
            exact for bfloat16 checkpoints) for the vision linears, the
            LM linears and the LM head (fast engine only). Defaults: vision ``"int8-dynamic"``,
            LM and head ``"int8-block"``. On a trained Qwen2 LM of MinerU2.5's shape with real
            document text (benchmarks/README.md, "Numerics on a trained language model", 943
            teacher-forced steps, AMD EPYC) the block-wise LM agreed with fp32 on 98.6 % of all
            steps and on all 493 confident ones (fp32 top-1 probability >= 0.5), against bf16's
            98.5 % / 99.8 % and llama.cpp Q8_0's 98.5 % / 100 %; per-channel INT8 on 94.3 % /
            99.8 %. Its decode steps read about as many bytes as per-channel INT8's (a float32
            scale per 32 weights: +12.5 %), its prefill GEMMs do a multiply-add per block and output.
        int8_kernel: the kernel of ``"int8-dynamic"`` layers: ``"onednn"`` or ``"int_mm"``
            (int8 activations per token), ``"torch_ao"`` (per tensor, 7 bits; the default until
            0.x) or ``"auto"`` (default): the faster recorded per-token kernel on this ISA class,
            ``onednn`` where nothing is recorded; per tensor only when asked for
            (``choice.choose_int8_kernel``; ``engine/quantize.py`` says what each does). Per token,
            each row of a linear's input (a token) has its own scale, so a sequence's numerics do
            not depend on what it is batched with (a row's output is bitwise the same alone or
            beside others; so are ``"int8-block"``'s); per tensor, one scale follows the largest
            value of the whole call. On the trained LM above, per tensor agreed with fp32 on 75.1 %
            of the confident steps and 55.6 % of all (1 of 12 free-running blocks identical, per
            channel 12 of 12; 2026-12-02, Xeon), for a per-page speed gain of 11 % (118.8 against
            132.9 s per page, ``mineru-fast bench --quick`` rows, AMD EPYC, 2026-12-01, 2 threads).
        vision_mode: ``"eager"``, ``"trace"`` (TorchScript trace + freeze per shape) or
            ``"compile"`` (``torch.compile``) for the vision encoder (fast engine only).
        vision_attention: the vision encoder's attention (fast engine, float32 precision, eager
            mode): ``"bf16"`` (default): this CPU class's fast attention
            (``engine.kernels.vision_attention_status``): on CPUs with AVX-512 BF16 the own kernel
            (``csrc/kernels.h``'s bfloat16 attention: queries, keys, values and probabilities
            rounded to bfloat16, dot products summed and the softmax taken in float32; a layout
            image's attention, 16 heads of 5,476 patches, ran 1.75x as fast as float32 SDPA and the
            encoder's layout pass in 0.71x the time, 2 threads, AMD EPYC, 2026-12-04;
            ``benchmarks/README.md``, "Vision attention on the own bfloat16 kernel"); on CPUs with
            AMX, PyTorch's SDPA over bfloat16 copies (AMX tiles); on CPUs with AVX2 but no AVX-512,
            the own float32 attention (``csrc/attention_avx2.cpp``: the layout pass in 0.89x the
            float32-SDPA time on an AMX Xeon capped to AVX2, 2 threads, 2026-12-06); on the other
            AVX-512 CPUs, and in the trace and compile modes, PyTorch's float32 attention.
            ``"fp32"``: PyTorch's float32 attention always. ``engine.numerics``'
            ``vision_attention`` says which ran.
        kv_dtype: storage dtype of the fast engine's KV buffers: ``"auto"`` (the precision's
            dtype), ``"fp32"`` or ``"bf16"`` (half the memory; each decode step then upcasts the
            keys and values it reads, which made decode attention ~3.7x slower than from a
            float32 store: 11 vs 3 ms per layer at batch 16 and 1500 positions, 2 threads).
        slots: sequences decoded together by the fast engine (its KV buffers hold this many).
        max_seq_len: prompt + generated tokens per slot (fast engine KV buffer length). None
            (default): room for the largest image prompt plus the largest ``max_new_tokens``, so
            output bounds count generated tokens only; the buffers are reserved, not committed,
            so the unused length costs no memory. A smaller value refuses requests that do not
            fit (an error, never a silent cut).
        page_window: pages whose layout passes, then whose crops, are batched together.
        repetition_window: fast engine repetition guard: a free-running sequence whose last N
            tokens are near-periodic (a loop, even one the no-repeat-n-gram rule keeps breaking)
            is ended with ``finish_reason="repetition"`` and its page marked partial (0 disables).
        speculative: fast engine speculative decoding: the most draft tokens a decode step verifies
            per request, an integer from 0 (default: off) to ``MAX_SPECULATIVE``; 6 is what
            ``benchmarks/speculative.py`` measured (module ``mineru_fast.engine.speculative``:
            n-gram drafts from the request's prompt text and own output and, in the advanced tier
            on a PDF page with a text layer, from the block's text there). The tokens are plain decoding's either
            way (bit for bit on the ``fast`` preset's arithmetic); only the number of decode steps
            changes. The reference engine refuses it.
        backend: ``"stock"`` (PyTorch), ``"ipex"`` (Intel Extension for PyTorch when installed and
            matching torch; the stock backend with a warning otherwise) or ``"auto"`` (what the
            recorded measurement says is faster on this CPU); fast engine only (see
            ``engine.backends``).
        threads: intra-op threads; None = the physical cores available to the process.
        max_pages: most pages one document may select; more is refused (``errors.TooManyPages``)
            before any page is read (default ``inputs.DEFAULT_MAX_PAGES``).
        dpi / max_side / max_image_pixels: input rendering and limits (see ``inputs``).
        render_timeout: seconds a PDF page may take to render; None = no bound, in this process
            (with a bound pages render in a child process, killed when one takes longer: that
            page fails alone with ``render_timeout``, and after two such pages the document's
            other pages fail unrendered; see ``inputs.open_document``).
        max_new_tokens: per-task bounds overriding ``protocol.SAMPLING``; keys ``"layout"``,
            ``"text"``, ``"table"``, ``"equation"``. Any mapping is accepted and stored as an
            immutable ``TokenBounds``.
        progress: show a tqdm progress bar over pages.
        model_version: ``"auto"`` (from the checkpoint's name, see ``protocol.detect_model_version``),
            ``"2509"`` (MinerU2.5-2509-1.2B) or ``"pro-2605"`` (MinerU2.5-Pro-2605-1.2B).
        image_analysis: read image and chart blocks with the "Image Analysis" prompt, as mineru 4
            does; None = on for MinerU2.5-Pro (trained for it), off for 2509 (which leaves them unread).
        tier: MinerU 4's pipeline tier. ``"advanced"`` (effort ``xhigh``): the VLM's own layout
            pass, then a VLM read of every block. ``"standard"`` (effort ``high``, MinerU 4's
            default): layout from PP-DocLayoutV2, text-like blocks from the PDF's text layer where
            ``ocr_mode`` resolves to ``"txt"``, the VLM reads only the other blocks. None (default):
            ``"standard"`` when ``layout_model`` is given, else ``"advanced"`` (``resolved_tier``);
            the standard tier needs a second model that a plain install does not have.
        ocr_mode: ``"auto"`` (per document, then per page: trust the PDF's text layer only when it
            passes MinerU 4's checks; images are always ``"ocr"``), ``"txt"`` (take text-like
            blocks from the PDF) or ``"ocr"`` (read every block from the page image). The
            advanced tier reads every block from the image; it accepts ``"auto"`` and ``"ocr"``.
        layout_model: PP-DocLayoutV2 for the standard tier: an ``.onnx`` file, a checkpoint or
            model-repository folder, or a hub id; None = MinerU 4's repositories in the hub cache
            (``layout.resolve_layout_weights``).
        layout_backend: ``"onnx"`` (ONNX Runtime), ``"torch"`` (transformers) or ``"auto"``
            (ONNX when onnxruntime is installed).
        confidence_threshold: flag blocks whose mean token log-probability (natural log, see
            ``Block.confidence``) is below this value (``Block.low_confidence``); None (default)
            flags nothing. Flags never change a page's status.

    Options are immutable and hashable; ``to_dict`` / ``from_dict`` give their JSON form.
    """

    engine: str = "fast"
    precision: str = "fp32"
    vision_quant: str = "int8-dynamic"
    lm_quant: str = "int8-block"
    lm_head_quant: str = "int8-block"
    int8_kernel: str = "auto"
    vision_mode: str = "eager"
    vision_attention: str = "bf16"
    kv_dtype: str = "auto"
    slots: int = 16
    max_seq_len: int | None = None
    page_window: int = 4
    repetition_window: int = 512
    speculative: int = 0
    backend: str = "stock"
    threads: int | None = None
    max_pages: int = DEFAULT_MAX_PAGES
    dpi: int = DEFAULT_DPI
    max_side: int = DEFAULT_MAX_SIDE
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    render_timeout: float | None = None
    max_new_tokens: Mapping[str, int] = field(default_factory=TokenBounds)
    progress: bool = False
    model_version: str = "auto"
    image_analysis: bool | None = None
    tier: str | None = None
    ocr_mode: str = "auto"
    layout_model: str | None = None
    layout_backend: str = "auto"
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, TokenBounds):
            object.__setattr__(self, "max_new_tokens", TokenBounds(self.max_new_tokens))
        choices = {
            "engine": ENGINES,
            "precision": PRECISIONS,
            "vision_quant": QUANTIZATIONS,
            "lm_quant": QUANTIZATIONS,
            "lm_head_quant": QUANTIZATIONS,
            "int8_kernel": INT8_KERNELS,
            "vision_mode": VISION_MODES,
            "vision_attention": VISION_ATTENTIONS,
            "kv_dtype": KV_DTYPES,
            "backend": BACKENDS,
            "ocr_mode": OCR_MODES,
            "layout_backend": LAYOUT_BACKENDS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.model_version not in ("auto", *MODEL_VERSIONS):
            raise ValueError(f"model_version must be one of {('auto', *MODEL_VERSIONS)}, got {self.model_version!r}")
        if self.tier is not None and self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS} (or None), got {self.tier!r}")
        if self.resolved_tier == "advanced" and self.ocr_mode == "txt":
            raise ValueError("ocr_mode 'txt' needs tier 'standard' (the advanced tier reads every block from images)")
        if self.engine == "reference" and self.backend == "ipex":
            raise ValueError("backend 'ipex' applies to the fast engine only")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.repetition_window < 0:
            raise ValueError(f"repetition_window must be >= 0, got {self.repetition_window}")
        object.__setattr__(self, "speculative", check_speculative(self.speculative))
        if self.engine == "reference" and self.speculative:
            raise ValueError("speculative applies to the fast engine only")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        for name in ("slots", "page_window", "dpi", "max_side", "max_image_pixels", "max_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.render_timeout is not None and not (math.isfinite(self.render_timeout) and self.render_timeout > 0):
            raise ValueError(f"render_timeout must be a finite number > 0 or None, got {self.render_timeout}")
        for task, bound in self.max_new_tokens.items():
            if task not in TASKS:
                raise ValueError(f"max_new_tokens keys must be in {TASKS}, got {task!r}")
            if bound < 1:
                raise ValueError(f"max_new_tokens[{task!r}] must be >= 1, got {bound}")
        if self.confidence_threshold is not None and not self.confidence_threshold <= 0:
            raise ValueError(f"confidence_threshold is a log-probability (<= 0), got {self.confidence_threshold}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: every field by name (``max_new_tokens`` as a plain dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["max_new_tokens"] = dict(self.max_new_tokens)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParserOptions:
        """Options from ``to_dict``'s form.

        Raises:
            ValueError: an unknown field or an invalid value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ParserOptions fields: {unknown}")
        return cls(**data)

    @property
    def resolved_tier(self) -> str:
        """The tier parsed with: ``tier``, or ``"standard"`` when a ``layout_model`` is given, else
        ``"advanced"``."""
        if self.tier is not None:
            return self.tier
        return "standard" if self.layout_model is not None else "advanced"

    def sampling(self, task: str, *, replayed: bool = False) -> SamplingParams:
        """Sampling parameters of a task (``"layout"`` or a block type), bounds applied.

        Args:
            task: ``"layout"`` or a block type.
            replayed: the request replays a trace's output: ``max_new_tokens`` bounds free decoding
                only, so the protocol's own bound applies (``protocol.SAMPLING``) and the trace's
                output comes out whole, as the service has always replayed it.
        """
        params = sampling_for(task)
        key = task if task in TASKS else "text"
        if key in self.max_new_tokens and not replayed:
            params = replace(params, max_new_tokens=self.max_new_tokens[key])
        return params

    def resolved_image_analysis(self, model_version: str) -> bool:
        """Whether images and charts are read, for a resolved model version."""
        return model_version == "pro-2605" if self.image_analysis is None else self.image_analysis

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ParserOptions:
        """Named starting points (see ``PRESETS``; ``"auto"``: chosen for this CPU's ISA class from
        recorded measurements, see ``runtime.choice``), with field overrides.

        Raises:
            ValueError: unknown preset name or invalid override.
        """
        if name == "auto":
            preset, fields = CANDIDATES[choose_preset().value]
            return cls.preset(preset, **{**fields, **overrides})
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {PRESET_NAMES}")
        return replace(PRESETS[name], **overrides)


_FLOAT: dict[str, Any] = {"vision_quant": "none", "lm_quant": "none", "lm_head_quant": "none"}

PRESETS: dict[str, ParserOptions] = {
    # The fast engine's measured best on CPU (see benchmarks/README.md).
    "fast": ParserOptions(),
    # Fast engine, float32 math, no quantization: the same tokens as the reference engine. Weights
    # stay in the checkpoint's bfloat16 and are upcast per call (bit-identical, half the memory;
    # the cast is negligible next to a vision pass, and decode steps upcast chunk by chunk in
    # cache: quantize.UPCAST_CHUNK_MAX_ROWS).
    "exact": ParserOptions(
        precision="fp32",
        vision_attention="fp32",
        kv_dtype="auto",
        repetition_window=0,
        vision_quant="bf16-weights",
        lm_quant="bf16-weights",
        lm_head_quant="bf16-weights",
    ),
    # Fast engine, bfloat16 weights and activations.
    "bf16": ParserOptions(precision="bf16", **_FLOAT),
    # transformers generate at batch 1 in bf16, as MinerU's official client runs it.
    "reference": ParserOptions(engine="reference", precision="bf16", page_window=1, **_FLOAT),
    # The same in float32.
    "reference-fp32": ParserOptions(engine="reference", precision="fp32", page_window=1, **_FLOAT),
}

PRESET_NAMES = sorted([*PRESETS, "auto"])  # "auto" is resolved per machine by ParserOptions.preset
