"""The OpenAI-compatible chat endpoint: what MinerU's http client sends, the same tokens as the
parser's own requests, and mineru-vl-utils' official client against a real ``mineru-fast serve``."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import pytest
from samples import text_page
from serve_helpers import running_server

from mineru_fast.protocol import SYSTEM_PROMPT, SamplingParams, prompt_for
from mineru_fast.serve.chat import ChatImageDecoder, ChatRequest, to_generation_request
from mineru_fast.serve.errors import ApiError
from mineru_fast.serve.jobs import CostBudget


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mineru_body(image, prompt: str, **sampling) -> dict:
    """The body mineru-vl-utils 2.x's http client builds (image first, greedy, no-repeat-n-gram)."""
    user = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": prompt}]
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
        "temperature": 0.0,
        "top_p": 0.01,
        "top_k": 1,
        "presence_penalty": 1.0,
        "frequency_penalty": 0.05,
        "repetition_penalty": 1.0,
        "vllm_xargs": {"no_repeat_ngram_size": 100, "debug": False},
        "skip_special_tokens": False,
    }
    return {**body, **sampling}


CROP = text_page().crop((40, 40, 700, 300))


def unbounded_decoder() -> ChatImageDecoder:
    return ChatImageDecoder(CostBudget(None), max_pixels=10**8)


def test_a_body_that_is_not_json_is_a_422_saying_so_before_any_model_is_needed():
    from mineru_fast.serve import ServeConfig, create_app

    app = create_app(ServeConfig(model="unused"))  # ASGITransport runs no lifespan: nothing loads

    async def post(content: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            headers = {"content-type": "application/json"}
            return await client.post("/v1/chat/completions", content=content, headers=headers)

    for content, message in [
        (
            b"{not json",
            "the body is not valid JSON: Expecting property name enclosed in double quotes (at character 1)",
        ),
        (b'{"model": "m", "messages": [}', "the body is not valid JSON: Expecting value (at character 28)"),
        (b'{"model": "m"}', "messages: Field required"),
    ]:
        response = asyncio.run(post(content))
        assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"
        assert response.json()["error"]["message"] == message


def test_mineru_request_becomes_the_parsers_request():
    body = ChatRequest.model_validate(mineru_body(CROP, prompt_for("text"), max_completion_tokens=64, max_tokens=64))
    request = to_generation_request(body, max_new_tokens=4096, decode=unbounded_decoder())
    assert request.prompt == "\nText Recognition:" and request.system == SYSTEM_PROMPT
    assert not request.text_before_image and request.image.size == CROP.size
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (1.0, 0.05, 1.0)
    assert (sampling.no_repeat_ngram_size, sampling.max_new_tokens, sampling.min_new_tokens) == (100, 64, 0)
    text_first = mineru_body(CROP, "")
    text_first["messages"][1]["content"].reverse()
    text_first["messages"][1]["content"][0]["text"] = "\nTable Recognition:"
    request = to_generation_request(ChatRequest.model_validate(text_first), 4096, unbounded_decoder())
    assert request.text_before_image and request.sampling.max_new_tokens == 4096  # the server's bound


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"temperature": 0.7, "top_k": 50}, "unsupported_sampling"),
        ({"max_tokens": 100_000}, "max_tokens_too_large"),
        ({"url": "https://example.com/a.png"}, "unsupported_image_url"),
        ({"url": "data:image/png;base64,@@@"}, "bad_image_url"),
        ({"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}, "bad_image"),
        ({"images": 2}, "unsupported_messages"),
    ],
)
def test_requests_this_server_cannot_serve_are_refused_with_a_reason(change, code):
    body = mineru_body(CROP, "\nText Recognition:")
    if "url" in change:
        body["messages"][1]["content"][0]["image_url"]["url"] = change.pop("url")
    if change.pop("images", None):
        body["messages"][1]["content"].append(body["messages"][1]["content"][0])
    with pytest.raises(ApiError) as info:
        to_generation_request(ChatRequest.model_validate({**body, **change}), 4096, unbounded_decoder())
    assert info.value.code == code and info.value.status in (400, 422)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running_server(tiny_model, tmp_path_factory.mktemp("chat"), "--max-new-tokens", "layout=24,text=12") as s:
        yield s


def test_chat_gives_the_tokens_of_the_parsers_own_request(server, tiny_model):
    """Same image and prompt through both doors: the same greedy tokens (the server runs the exact
    preset on one thread, as this in-process engine does)."""
    from mineru_fast import DocumentParser, ParserOptions
    from mineru_fast.engine.base import GenerationRequest

    parser = DocumentParser.from_pretrained(tiny_model, ParserOptions.preset("exact", threads=1))
    sampling = SamplingParams(presence_penalty=1.0, frequency_penalty=0.05, max_new_tokens=12)  # MinerU's text rules
    (expected,) = parser.engine.generate([GenerationRequest(CROP, prompt_for("text"), sampling)])
    parser.close()
    models = httpx.get(f"{server.url}/v1/models").json()
    (model,) = models["data"]
    body = mineru_body(CROP, prompt_for("text"), model=model["id"], max_tokens=12)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    assert choice["message"]["content"] == expected.text
    assert choice["finish_reason"] == ("stop" if expected.finish_reason == "stop" else "length")
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and expected.text in streamed.text.replace("\\n", "\n")
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "temperature": 1.0, "top_k": 40})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_sampling"


def test_official_mineru_client_runs_against_the_server(server):
    """mineru-vl-utils' own ``http-client`` backend (what mineru 4 uses for a remote VLM): it finds
    the model, runs the two-step extraction of a page and reads crops; nothing is refused."""
    from mineru_vl_utils import MinerUClient
    from mineru_vl_utils.mineru_client import DEFAULT_SAMPLING_PARAMS, MinerUSamplingParams

    bounded = {
        key: MinerUSamplingParams(
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty, max_new_tokens=16
        )
        for key, params in DEFAULT_SAMPLING_PARAMS.items()
    }
    client = MinerUClient(backend="http-client", server_url=server.url, sampling_params=bounded, use_tqdm=False)
    before = len(chat_requests(server))
    blocks = client.two_step_extract(text_page())  # random weights: whatever it decodes, it comes back
    assert isinstance(blocks, list)
    after_layout = chat_requests(server, at_least=before + 1)
    assert len(after_layout) >= before + 1
    before = len(after_layout)
    for kind in ("text", "table", "equation"):
        client.content_extract(CROP, kind)  # the client raises on any answer it cannot use
    requests = chat_requests(server, at_least=before + 3)
    assert [r["status"] for r in requests[before:]] == [200, 200, 200]


def chat_requests(server, at_least: int = 0, bound_s: float = 30.0) -> list[dict]:
    """The server's chat request log records. The access-log line is written after the response
    is sent, so a reader waits (bounded) until ``at_least`` records are there."""
    deadline = time.monotonic() + bound_s
    while True:
        records = [
            r for r in server.log_records() if r.get("route") == "/v1/chat/completions" and r["message"] == "request"
        ]
        if len(records) >= at_least or time.monotonic() > deadline:
            return records
        time.sleep(0.05)
