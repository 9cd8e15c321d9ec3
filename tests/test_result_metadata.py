"""The result's metadata, schema, structured errors, counts and block confidence (issue 16)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from samples import SAMPLE_CONTENTS, SAMPLE_LAYOUT, pdf_bytes, sample_trace, text_page

from mineru_fast import DocumentParser, ParserOptions, __version__
from mineru_fast.cli.main import main
from mineru_fast.options import TokenBounds
from mineru_fast.protocol.traces import PageTrace, Trace
from mineru_fast.results.metadata import SCHEMA_PATH, SCHEMA_VERSION, load_schema
from mineru_fast.results.page import Confidence, ParseError
from mineru_fast.results.writer import CONFIDENCE_FIELD, render_page

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the dev extra) validates results")

THRESHOLD = -5.0  # mean log-probability; the tiny model's own tokens score about 0, forced prose about -40


@pytest.fixture(scope="module")
def parser(tiny_model):
    return DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact", confidence_threshold=THRESHOLD))


@pytest.fixture(scope="module")
def validator():
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def two_pages(parser):
    """A replayed two-page PDF: its bytes and its Document."""
    data = pdf_bytes(2)
    return data, parser.parse(data, replay=sample_trace(2))


def forced_len(parser, text: str) -> int:
    return len(parser.engine.preprocessor.forced_ids(text))  # the text's tokens and the end token


def test_parse_result_validates_against_the_shipped_schema(parser, two_pages, validator, tmp_path):
    data, document = two_pages
    result = json.loads(json.dumps(document.to_dict()))
    validator.validate(result)
    assert SCHEMA_PATH.is_file() and SCHEMA_PATH.parent.name == "schema"

    meta = result["metadata"]
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["package"] == {"name": "mineru-fast", "version": __version__}
    saved = meta["input"]["properties"].get("created_at", "")  # Pillow's writer dates a PDF when it saves it
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", saved), saved
    assert meta["input"] == {
        "name": "document",
        "format": "pdf",
        "sha256": hashlib.sha256(data).hexdigest(),
        "page_count": 2,
        "pages": [0, 1],
        "warnings": [],
        "properties": {"created_at": saved, "modified_at": saved},
        "page_geometry": [{"page_idx": i, "width_pt": 612.0, "height_pt": 792.0} for i in (0, 1)],  # 100 dpi
    }
    assert meta["model"] == {
        "model_id": None,
        "revision": None,
        "commit": None,
        "name": "tiny",
        "protocol_version": "pro-2605",  # a synthetic model follows MinerU 4's Pro-2605 unless told
    }
    assert meta["tier"] == "advanced"
    assert ParserOptions.from_dict(meta["options"]) == parser.options
    assert meta["runtime"]["precision"] == "fp32" and meta["runtime"]["int8_kernel"] is None  # exact: no INT8

    # The streamed <stem>.json is the same document.
    document.save(tmp_path / "out", layout="2.x")
    written = json.loads((tmp_path / "out" / "document.json").read_text())
    assert written == result

    # The schema is strict where it matters: an error as a bare string, or a token count among
    # the timings, is refused.
    broken = json.loads(json.dumps(result))
    broken["pages"][0]["errors"] = ["something failed"]
    assert not validator.is_valid(broken)
    broken = json.loads(json.dumps(result))
    broken["pages"][0]["timings"]["tokens"] = "12"
    assert not validator.is_valid(broken)


def test_timings_are_seconds_and_token_counts_apart(parser, two_pages):
    _, document = two_pages
    assert set(document.timings) == {"render", "vision", "prefill", "decode", "total", "wall"}
    assert all(isinstance(v, float) and v >= 0 for v in document.timings.values())
    # the image's analysis (Pro-2605) is replayed as the empty answer: its end token
    contents = [c if c is not None else "" for c in SAMPLE_CONTENTS]
    per_page = forced_len(parser, SAMPLE_LAYOUT) + sum(forced_len(parser, c) for c in contents)
    for page in document.pages:
        assert page.counts["requests"] == 5  # the layout and every block (the image analysed)
        assert page.counts["generated_tokens"] == per_page
        assert page.counts["prompt_tokens"] > 4 * per_page  # image tokens included
    assert document.counts == {k: 2 * document.pages[0].counts[k] for k in document.pages[0].counts}


def test_errors_are_structured(parser, validator):
    garbage = Trace([PageTrace("no layout here at all", [])])
    (page,) = parser.parse([text_page()], replay=garbage).pages
    assert page.status == "failure"
    assert page.errors == [ParseError("layout_unreadable", "layout output holds no valid block", 0)]
    assert str(page.errors[0]) == "layout_unreadable: layout output holds no valid block"

    (bad,) = parser.parse_many([b"not a document"])
    assert bad.status == "failure" and [e.code for e in bad.errors] == ["unsupported_format"]
    assert bad.errors[0].page is None and bad.errors[0].message.startswith("document: ")
    result = bad.to_dict()
    validator.validate(result)
    assert result["metadata"]["input"] is None and result["metadata"]["model"]["name"] == "tiny"


def test_every_error_class_has_a_stable_code_and_raised_errors_agree_with_results(parser):
    """``parse()``'s exceptions had no machine-readable code while ``ParseError`` records had one,
    and a record's message repeated the class name (``unsupported_format: UnsupportedFormat: ...``)."""
    from mineru_fast import errors
    from mineru_fast.distributed import RayDependencyError
    from mineru_fast.distributed.batch import BatchError
    from mineru_fast.runtime.launch import LaunchError
    from mineru_fast.serve import ServeDependencyError
    from mineru_fast.serve.errors import from_exception

    def family(cls: type) -> list[type]:
        return [cls, *(sub for child in cls.__subclasses__() for sub in family(child))]

    classes = set(family(errors.MineruFastError))
    assert {RayDependencyError, BatchError, LaunchError, ServeDependencyError} <= classes
    pattern = load_schema()["$defs"]["error"]["properties"]["code"]["pattern"]
    for cls in classes:
        assert "code" in vars(cls) and re.fullmatch(pattern, cls.code), cls  # its own, as the schema allows
    today = {
        "UnsupportedFormat": "unsupported_format",
        "CorruptDocument": "corrupt_document",
        "PasswordRequired": "password_required",
        "ImageTooLarge": "image_too_large",
        "PageRangeError": "bad_page_range",
        "InputError": "invalid_document",
        "TraceError": "bad_replay_trace",
    }
    assert {name: getattr(errors, name).code for name in today} == today  # the codes results used before

    with pytest.raises(errors.UnsupportedFormat) as raised:
        parser.parse(b"not a document")
    (bad,) = parser.parse_many([b"not a document"])
    assert bad.errors == [ParseError("unsupported_format", str(raised.value), None)]
    assert raised.value.code == "unsupported_format" and "UnsupportedFormat" not in str(bad.errors[0])
    api = from_exception(raised.value)  # the service's error body says the same
    assert (api.status, api.code, api.message) == (422, bad.errors[0].code, bad.errors[0].message)
    with pytest.raises(errors.PageRangeError) as raised_range:
        parser.parse(pdf_bytes(1), pages="3")
    assert raised_range.value.code == "bad_page_range"


def test_options_are_immutable_hashable_and_serializable():
    options = ParserOptions(max_new_tokens={"text": 5, "layout": 64}, confidence_threshold=-1.0)
    assert isinstance(options.max_new_tokens, TokenBounds)
    assert options.max_new_tokens == {"layout": 64, "text": 5} and options.sampling("text").max_new_tokens == 5
    with pytest.raises(TypeError):
        options.max_new_tokens["text"] = 6  # type: ignore[index]
    assert hash(options) == hash(ParserOptions(max_new_tokens={"layout": 64, "text": 5}, confidence_threshold=-1.0))
    assert len({options, ParserOptions(), ParserOptions()}) == 2
    data = json.loads(json.dumps(options.to_dict()))
    assert data["max_new_tokens"] == {"layout": 64, "text": 5} and data["confidence_threshold"] == -1.0
    assert ParserOptions.from_dict(data) == options
    with pytest.raises(ValueError, match="unknown ParserOptions fields"):
        ParserOptions.from_dict({**data, "color": "red"})
    with pytest.raises(ValueError, match="confidence_threshold"):
        ParserOptions(confidence_threshold=0.5)


def test_improbable_block_is_flagged(parser):
    """The tiny model (random weights) says "\\n" with probability ~1 on every crop; forced prose is
    improbable under it. Replay reports the forced tokens' log-probabilities, so the prose block,
    and only it, falls below the threshold."""
    prose = "A replayed paragraph of body text."
    trace = Trace([PageTrace(SAMPLE_LAYOUT, ["\n", prose, None, "\n"])])
    (page,) = parser.parse([text_page()], replay=trace).pages
    title, text, image, caption = page.blocks
    assert [b.type for b in page.blocks] == ["title", "text", "image", "image_caption"]
    assert len(text.logprobs) == forced_len(parser, prose) - 1  # the end token left out
    assert text.confidence == Confidence.of(text.logprobs)
    assert text.confidence.mean_logprob < THRESHOLD and text.low_confidence
    for block in (title, caption):
        assert block.confidence.tokens == 1 and block.confidence.mean_logprob > -0.1 and not block.low_confidence
    # Pro-2605 reads images; the trace holds no analysis for this one, replayed as the empty answer:
    # no token but the end token, which is no part of a block's text
    assert image.confidence is None and not image.low_confidence
    assert page.status == "success"  # a flag is advice to review, not a failure

    record = page.to_dict()["blocks"][1]
    assert record["confidence"] == text.confidence.to_dict() and record["low_confidence"] is True

    plain = render_page(page).content_list
    assert all(CONFIDENCE_FIELD not in item for item in plain)  # MinerU's format by default
    extended = render_page(page, confidence=True).content_list
    assert [CONFIDENCE_FIELD in item for item in extended] == [True] * len(plain)
    by_text = {item.get("text"): item[CONFIDENCE_FIELD] for item in extended}
    assert by_text[prose] == {**text.confidence.to_dict(), "low_confidence": True}
    print(
        f"flagged: mean {text.confidence.mean_logprob:.2f} min {text.confidence.min_logprob:.2f}; "
        f"others: mean {title.confidence.mean_logprob:.2e} / {caption.confidence.mean_logprob:.2e}"
    )


def test_cli_writes_metadata_and_the_confidence_extension(tiny_model, validator, tmp_path, capsys):
    image = tmp_path / "scan.png"
    text_page().save(image)
    trace = tmp_path / "trace.json"
    Trace([PageTrace(SAMPLE_LAYOUT, ["\n", "A replayed paragraph of body text.", None, "\n"])]).save(trace)
    out = tmp_path / "out"
    args = ["parse", str(image), "-o", str(out), "--model", str(tiny_model), "--replay", str(trace)]
    argv = [*args, "--preset", "exact", "--confidence", "--confidence-threshold", "-5", "--quiet", "-f", "2.x"]
    assert main(argv) == 0
    result = json.loads((out / "scan" / "scan.json").read_text())
    validator.validate(result)
    assert result["metadata"]["input"]["sha256"] == hashlib.sha256(image.read_bytes()).hexdigest()
    assert result["metadata"]["input"]["format"] == "PNG"
    assert result["metadata"]["options"]["confidence_threshold"] == -5.0
    assert [b["low_confidence"] for b in result["pages"][0]["blocks"]] == [False, True, False, False]
    items = json.loads((out / "scan" / "scan_content_list.json").read_text())
    # The empty title and caption leave no item of their own; the image's analysis is empty (no token).
    assert {item["type"]: item[CONFIDENCE_FIELD] for item in items} == {
        "text": {**result["pages"][0]["blocks"][1]["confidence"], "low_confidence": True},
        "image": None,
    }


def test_an_animations_dropped_frames_are_said_in_the_result(parser, validator):
    """Audit round 4, N14: the result of an animated GIF says its later frames were not read
    (``metadata.input.warnings``); they were dropped without a word."""
    from PIL import Image
    from samples import image_bytes

    frames = [Image.new("RGB", (600, 400), colour) for colour in ("white", "gray")]
    document = parser.parse(
        image_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:]), replay=sample_trace(1)
    )
    result = json.loads(json.dumps(document.to_dict()))
    validator.validate(result)
    assert result["metadata"]["input"]["warnings"] == [
        "document: an animated GIF: only its first frame is read; the other frames are dropped "
        "(save them as a multi-page TIFF or PDF to read each as a page)"
    ]
