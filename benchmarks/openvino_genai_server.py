"""An OpenAI-style chat endpoint over OpenVINO GenAI's continuous-batching pipeline, for the side by side.

OpenVINO GenAI ships no HTTP server of its own on the package index (OpenVINO Model Server, which
serves the same pipeline over an OpenAI API, is a container image and a binary, not a wheel), so
``llamacpp_side_by_side.py`` runs this small one in OpenVINO's own virtual environment (it imports
only the standard library, numpy, Pillow and ``openvino_genai``; never mineru-fast). What it does
is what OpenVINO Model Server does with a VLM: one ``ContinuousBatchingPipeline`` (GenAI's VLM
continuous batching: paged KV cache, requests joining and leaving between steps) driven by one
thread calling ``step()``; every HTTP request adds a request to it and waits for its handle.

Requests: ``POST /v1/chat/completions`` with MinerU's body (a system message; a user message of an
``image_url`` PNG ``data:`` URL and a text prompt), ``max_tokens``, ``min_tokens``, ``ignore_eos``,
``temperature`` 0 (greedy), ``presence_penalty`` and ``frequency_penalty``, each set on GenAI's
``GenerationConfig``. The prompt is the checkpoint's chat template applied by
GenAI's tokenizer, the image at its place as GenAI's image tag; the answer's ``usage`` is GenAI's
own count (its perf metrics' input tokens, the generated ids).
``GET /health`` answers 200 once the pipeline is compiled.

    <openvino venv>/bin/python openvino_genai_server.py MODEL_DIR --port P --threads N [--cache-gb 2]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import openvino as ov
import openvino_genai as genai
from PIL import Image

IMAGE_TAG = "<ov_genai_image_{}>"  # GenAI's model-independent image placeholder in a prompt


class Pending:
    """One request in the pipeline: its handle once added, and the event its HTTP thread waits on."""

    def __init__(self, prompt: str, images: list, config: genai.GenerationConfig) -> None:
        self.prompt, self.images, self.config = prompt, images, config
        self.done = threading.Event()
        self.handle = None
        self.error: str | None = None


class Engine:
    """The pipeline and the one thread that steps it."""

    def __init__(self, model_dir: str, threads: int, cache_gb: int) -> None:
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = cache_gb
        properties = {"INFERENCE_NUM_THREADS": threads}
        self.pipe = genai.ContinuousBatchingPipeline(
            model_dir, scheduler, "CPU", properties, {}, vision_encoder_properties=properties
        )
        self.tokenizer = self.pipe.get_tokenizer()
        self.incoming: queue.Queue[Pending] = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        running: list[Pending] = []
        while True:
            if not running:
                running.append(self.incoming.get())  # idle: block until a request arrives
            while not self.incoming.empty():
                running.append(self.incoming.get_nowait())
            for item in [p for p in running if p.handle is None]:
                try:
                    item.handle = self.pipe.add_request(self.next_id, item.prompt, item.images, item.config)
                    self.next_id += 1
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                    item.error = repr(exc)
                    item.done.set()
                    running.remove(item)
            try:
                if self.pipe.has_non_finished_requests():
                    self.pipe.step()
                finished = [p for p in running if p.handle.get_status() != genai.GenerationStatus.RUNNING]
            except Exception as exc:  # noqa: BLE001 - the pipeline failed: every request in it fails, none waits forever
                for item in running:
                    item.error = f"the pipeline failed: {exc!r}"
                    item.done.set()
                running.clear()
                continue
            for item in finished:
                running.remove(item)
                item.done.set()

    def chat(self, body: dict) -> dict:
        """One chat completion; ``{"text", "usage", "finish_reason"}``. Raises ``ValueError`` on a
        request this endpoint does not take, ``RuntimeError`` when the pipeline failed it."""
        images, history = [], []
        for message in body["messages"]:
            content = message["content"]
            if isinstance(content, str):
                history.append({"role": message["role"], "content": content})
                continue
            text = ""
            for part in content:
                if part["type"] == "image_url":
                    url = part["image_url"]["url"]
                    if not url.startswith("data:image/"):
                        raise ValueError("only data: image URLs are taken")
                    pixels = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
                    text += IMAGE_TAG.format(len(images))
                    images.append(ov.Tensor(np.asarray(pixels, dtype=np.uint8)[None]))
                elif part["type"] == "text":
                    text += part["text"]
            history.append({"role": message["role"], "content": text})
        prompt = self.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        config = genai.GenerationConfig()
        config.apply_chat_template = False  # applied above, with the system message MinerU sends
        config.max_new_tokens = int(body["max_tokens"])
        config.min_new_tokens = int(body.get("min_tokens", 0))
        config.ignore_eos = bool(body.get("ignore_eos", False))
        config.do_sample = float(body.get("temperature", 1.0)) > 0
        config.presence_penalty = float(body.get("presence_penalty", 0.0))
        config.frequency_penalty = float(body.get("frequency_penalty", 0.0))
        config.repetition_penalty = float(body.get("repetition_penalty", 1.0))
        item = Pending(prompt, images, config)
        self.incoming.put(item)
        item.done.wait()
        if item.error is not None:
            raise RuntimeError(item.error)
        status = item.handle.get_status()
        if status != genai.GenerationStatus.FINISHED:
            raise RuntimeError(f"generation ended with status {status}")
        output = item.handle.read_all()[0]
        metrics = item.handle.get_vlm_perf_metrics()
        return {
            "text": self.tokenizer.decode(list(output.generated_ids)),
            "usage": {
                "prompt_tokens": int(metrics.get_num_input_tokens()),
                "completion_tokens": len(output.generated_ids),
            },
            "finish_reason": "length" if len(output.generated_ids) >= config.max_new_tokens else "stop",
        }


def serve(engine: Engine, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(200 if self.path == "/health" else 404, {"status": "ok"})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/v1/chat/completions":
                self._answer(404, {"error": "not found"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                result = engine.chat(body)
            except (ValueError, KeyError) as exc:
                self._answer(400, {"error": repr(exc)})
                return
            except RuntimeError as exc:
                self._answer(500, {"error": str(exc)})
                return
            self._answer(
                200,
                {
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": result["text"]},
                            "finish_reason": result["finish_reason"],
                        }
                    ],
                    "usage": result["usage"],
                },
            )

        def log_message(self, *args) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # the listen backlog: many requests arrive at once (socketserver's default 5)

    Server(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--cache-gb", type=int, default=2, help="the paged KV cache, GB (SchedulerConfig.cache_size)")
    args = p.parse_args()
    serve(Engine(args.model_dir, args.threads, args.cache_gb), args.port)


if __name__ == "__main__":
    main()
