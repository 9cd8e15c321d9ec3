"""The source's declared properties and page geometry, as MinerU 4 records them (``inputs.properties``),
and every door writing them into the bundle (``metadata.document``, ``extensions.docvortex_layout``).

Official's own values for the same files are compared in the official lane
(test_official_bundle: whole files, a PDF declaring properties in its information dictionary and
XMP packet, a turned page, rotated crops, page images).
"""

from __future__ import annotations

import io
import json
import struct

import pytest
from PIL import Image
from pypdf import PdfReader, PdfWriter
from pypdf.generic import NameObject, StreamObject, TextStringObject
from samples import SAMPLE_CONTENTS, pdf_bytes

from mineru_fast.inputs.documents import open_document
from mineru_fast.inputs.properties import image_page_points, property_date
from mineru_fast.protocol.traces import PageTrace, Trace
from mineru_fast.results.metadata import InputInfo, load_schema

jsonschema = pytest.importorskip("jsonschema")

XMP = b"""<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?>
<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">
<rdf:Description rdf:about="" xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:xmp="http://ns.adobe.com/xap/1.0/">
<dc:title><rdf:Alt><rdf:li xml:lang="x-default">Not used</rdf:li></rdf:Alt></dc:title>
<dc:creator><rdf:Seq><rdf:li>Ann</rdf:li><rdf:li>Bob</rdf:li><rdf:li>Ann</rdf:li></rdf:Seq></dc:creator>
<dc:subject><rdf:Bag><rdf:li>kw1</rdf:li><rdf:li>kw2</rdf:li></rdf:Bag></dc:subject>
<xmp:ModifyDate>2024-03-05T10:00:00</xmp:ModifyDate>
</rdf:Description></rdf:RDF></x:xmpmeta>
<?xpacket end="w"?>"""


def declared_pdf(info: dict[str, str], *, xmp: bool = True, lang: str | None = "en-GB", pages: int = 2) -> bytes:
    """An image PDF of ``pages`` pages with exactly ``info`` as its information dictionary, an XMP
    packet, a catalog language, and its last page turned by 90 degrees."""
    writer = PdfWriter(clone_from=io.BytesIO(pdf_bytes(pages)))
    writer.metadata = info  # replaces Pillow's dictionary (its dates are the time of saving)
    writer.pages[-1].rotate(90)
    if xmp:
        packet = StreamObject()
        packet.set_data(XMP)
        writer._root_object[NameObject("/Metadata")] = writer._add_object(packet)
    if lang:
        writer._root_object[NameObject("/Lang")] = TextStringObject(lang)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


@pytest.mark.parametrize(
    ("declared", "iso"),
    [
        ("D:20240102030405+01'00'", "2024-01-02T03:04:05+01:00"),
        ("D:20240102030405-0530", "2024-01-02T03:04:05-05:30"),
        ("D:20240102030405Z", "2024-01-02T03:04:05Z"),
        ("D:2024010203", "2024-01-02T03"),  # the precision declared, nothing made up
        ("D:202401", "2024-01"),
        ("D:2024", "2024"),
        ("D:20241302", None),  # month 13
        ("D:2024-01-02", None),  # not a PDF date
        ("2024-03-05T10:00:00", "2024-03-05T10:00:00"),  # ISO text (XMP) keeps having no zone
        (" \x002024-03-05 ", "2024-03-05"),
        ("", None),
        (20240102, None),  # not text
    ],
)
def test_declared_dates_at_their_precision(declared, iso):
    warnings: list[str] = []
    assert property_date(declared, warnings) == iso
    assert bool(warnings) == (iso is None and isinstance(declared, str) and declared.strip("\x00 ") != "")


def test_information_dictionary_first_then_catalog_language_then_xmp():
    data = declared_pdf({
        "/Title": "  A title\x00 ", "/Author": "Ann; Bob", "/CreationDate": "D:20240102030405+01'00'",
        "/ModDate": "D:2024-bad", "/Producer": "", "/Creator": "A writer",
    })  # fmt: skip
    with open_document(data) as opened:
        properties, warnings = opened.properties()
    expected = {
        "title": "A title",  # the dictionary's, stripped; XMP's is not used
        "authors": ["Ann; Bob"],  # one string is one author
        "subject": "kw1",  # XMP: the first of dc:subject
        "keywords": ["kw1", "kw2"],  # XMP: pdf:Keywords is absent, dc:subject stands in
        "languages": ["en-GB"],  # the catalog's /Lang
        "created_at": "2024-01-02T03:04:05+01:00",
        "modified_at": "2024-03-05T10:00:00",  # the dictionary's is malformed: XMP's, zone-less as written
        "creator_application": "A writer",  # an empty /Producer is none
    }
    assert json.dumps(properties) == json.dumps(expected)  # in metadata.document's order
    assert warnings == ["Invalid declared date: D:2024-bad"]


def test_a_pdf_declaring_nothing_and_an_image_have_no_properties():
    with open_document(declared_pdf({}, xmp=False, lang=None)) as opened:
        assert opened.properties() == ({}, [])
    with open_document(Image.new("RGB", (10, 10))) as opened:
        assert opened.properties() == ({}, [])


def single(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def test_page_geometry_in_points_as_displayed():
    """A PDF page's visible box as PDFium reads it (single precision), swapped on a turned page;
    an image at 200 dpi after its EXIF orientation."""
    data = declared_pdf({}, xmp=False, lang=None)
    with open_document(data) as opened:
        first, turned = opened.page_points(0), opened.page_points(1)
    box = PdfReader(io.BytesIO(data)).pages[0].mediabox
    assert first == (single(float(box.width)), single(float(box.height))) and turned == first[::-1]
    assert first == (single(850 * 72 / 100), single(1100 * 72 / 100))  # samples.pdf_bytes: 100 dpi
    image = Image.new("RGB", (801, 600))
    assert image_page_points(image) == (single(801 * 72 / 200), single(216.0)) == (288.3599853515625, 216.0)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed 600 x 801
    turned_image = Image.open(io.BytesIO(_jpeg(image, exif)))
    assert image_page_points(turned_image) == (216.0, 288.3599853515625)


def _jpeg(image: Image.Image, exif: Image.Exif) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", exif=exif)
    return out.getvalue()


def test_input_info_carries_them_and_validates():
    with open_document(declared_pdf({"/Title": "T"}, xmp=False, lang=None), pages="2") as opened:
        info = InputInfo.from_opened(opened)
    assert info.properties == {"title": "T"}
    assert info.page_geometry == ({"page_idx": 1, "width_pt": single(792.0), "height_pt": single(612.0)},)
    schema = load_schema()
    jsonschema.validate(
        info.to_dict(), {"$defs": schema["$defs"], **schema["$defs"]["metadata"]["properties"]["input"]}
    )


ROTATED_LAYOUT = (
    "<|box_start|>100 080 900 140<|box_end|><|ref_start|>title<|ref_end|><|rotate_up|>\n"
    "<|box_start|>100 180 900 420<|box_end|><|ref_start|>text<|ref_end|><|rotate_up|>\n"
    "<|box_start|>100 460 900 820<|box_end|><|ref_start|>image<|ref_end|><|rotate_right|>\n"
    "<|box_start|>100 840 900 900<|box_end|><|ref_start|>image_caption<|ref_end|><|rotate_up|>"
)


def test_every_door_writes_the_same_document_fields_and_empty_pages(parser, tmp_path):
    """``Document.save``, the streaming ``DocumentWriter`` (as the CLI runs it) and the service's
    bundle (MinerU's v1 API hands it out) write the same ``metadata.document`` and
    ``extensions.docvortex_layout`` (the declared properties, each page's size, the rotated crop
    by its index), and a page without blocks between two others as official writes it:
    ``{"page_idx": 1}`` in the middle JSON (DocVortex's ``to_dict`` leaves the empty default out),
    ``"blocks": []`` in the structured content (test_official_bundle has official's own files)."""
    from mineru_fast.results.writer import DocumentWriter
    from mineru_fast.serve.bundle import BundleRequest, run_bundle

    data = declared_pdf({"/Title": "Declared", "/CreationDate": "D:2023"}, xmp=False, lang="fr", pages=3)
    path = tmp_path / "declared.pdf"
    path.write_bytes(data)
    full = PageTrace(ROTATED_LAYOUT, list(SAMPLE_CONTENTS))
    trace = Trace([full, PageTrace("", []), full])
    parser.parse(path, replay=trace).save(tmp_path / "whole")
    with open_document(path) as opened:
        info = InputInfo.from_opened(opened)
    with DocumentWriter(tmp_path / "streamed", "declared", metadata=parser.result_metadata(info)) as writer:
        for page in parser.iter_pages(path, replay=trace):
            writer.add_page(page)
    outputs = frozenset({"middle_json", "structured_content"})
    served = run_bundle(parser, BundleRequest(data=data, trace=trace, outputs=outputs))["bundle"]
    files = [
        [json.loads((tmp_path / kind / name).read_text()) for name in ("middle_json.json", "structured_content.json")]
        for kind in ("whole", "streamed")
    ]
    files.append([json.loads(served[name]["content"]) for name in ("middle_json", "structured_content")])
    width, height = single(850 * 72 / 100), single(1100 * 72 / 100)
    for middle, structured in files:
        for document in (middle, structured):
            assert document["metadata"]["document"] == {
                "title": "Declared", "languages": ["fr"], "created_at": "2023", "page_count": 3,
                "page_count_kind": "physical",
            }  # fmt: skip
            assert list(document["extensions"]) == ["mineru", "docvortex_layout", "mineru_fast"]
            assert document["extensions"]["docvortex_layout"] == {
                "version": 1,
                "pages": [
                    {"page_idx": 0, "width_pt": width, "height_pt": height, "image_rotations": {"2": 90}},
                    {"page_idx": 1, "width_pt": width, "height_pt": height},
                    {"page_idx": 2, "width_pt": height, "height_pt": width, "image_rotations": {"2": 90}},
                ],
            }
        assert middle["pages"][1] == {"page_idx": 1} and structured["pages"][1] == {"page_idx": 1, "blocks": []}
        assert middle["pages"][0]["blocks"] and structured["pages"][2]["blocks"]
    assert files[0][0]["pages"] == files[1][0]["pages"] == files[2][0]["pages"]


@pytest.fixture(scope="module")
def parser(tiny_model):
    from mineru_fast import DocumentParser, ParserOptions

    return DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact"))
