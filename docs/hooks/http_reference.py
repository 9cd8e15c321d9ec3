"""MkDocs hook: the HTTP endpoint reference, generated from the service's OpenAPI schema.

The schema comes from the FastAPI application of ``mineru-fast serve`` (``create_app(...).openapi()``)
at build time. Building the application loads no model (that happens when a server starts it), so
the site builds without weights and without starting a server.

A page holding the line ``<!-- generated: http-reference -->`` gets, in its place, every endpoint
with its parameters, request body and responses, then the schemas they refer to. The schema itself
is published beside the page as ``openapi.json``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

MARKER = "<!-- generated: http-reference -->"
SCHEMA_FILE = "openapi.json"

# Sections of the page, by path prefix; paths of no prefix here are the service's own.
# Each title carries its anchor, for links from the other pages.
_GROUPS = (
    ("OpenAI-compatible door {#openai-door}", ("/v1/chat/", "/v1/models")),
    (
        "MinerU's v1 document API {#mineru-v1-api}",
        ("/v1/health", "/v1/uploads", "/v1/files", "/v1/parse/", "/v1/tasks", "/v1/file_parse"),
    ),
)
_OWN = "The service's own endpoints {#own-endpoints}"
# FastAPI declares its own validation-error body on every route that takes input; the service
# answers those requests in its one error form instead (``422 invalid_request``), so the page says
# that and leaves FastAPI's schemas out. Request-body schemas (``Body_*``) are shown where they are used.
_VALIDATION = "#/components/schemas/HTTPValidationError"
_NOT_LISTED = ("HTTPValidationError", "ValidationError")
_ERROR_FORM = '`{"error": {"code", "message", "request_id"}}`'


@cache
def openapi_schema() -> dict[str, Any]:
    """The OpenAPI schema of the service with its default settings (no model is loaded)."""
    from mineru_fast.serve.app import create_app
    from mineru_fast.serve.config import ServeConfig

    return create_app(ServeConfig()).openapi()


def _text(value: str) -> str:
    """Docstring text as Markdown: reStructuredText's ``code`` spans become single backticks."""
    return re.sub(r"``(.+?)``", r"`\1`", value.strip())


def _cell(value: str) -> str:
    return _text(value).replace("\n", " ").replace("|", "\\|")


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^A-Za-z0-9_-]", "-", name)


def _type(schema: dict[str, Any]) -> str:
    """A schema's type in a few words, with links to named schemas."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type(part) for part in schema[key])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if kind == "string" and schema.get("contentMediaType") == "application/octet-stream":
        return "file"
    if isinstance(kind, list):
        return " or ".join(kind)
    return str(kind)


def _constraints(schema: dict[str, Any]) -> str:
    parts = []
    for key, word in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
    ):
        if key in schema and schema[key] < 1e30:
            value = schema[key]
            parts.append(f"{word} {int(value) if float(value).is_integer() else value}")
    for part in schema.get("anyOf", []):
        if part.get("type") != "null":
            parts.extend(c for c in _constraints(part).split("; ") if c)
    return "; ".join(dict.fromkeys(parts))


def _describe(schema: dict[str, Any]) -> str:
    words = [_cell(schema.get("description", ""))] if schema.get("description") else []
    limits = _constraints(schema)
    if limits:
        words.append(f"({limits})")
    if "default" in schema:
        words.append(f"default `{json.dumps(schema['default'])}`")
    return " ".join(words)


def _properties_table(schema: dict[str, Any]) -> list[str]:
    properties = schema.get("properties", {})
    if not properties:
        return []
    required = set(schema.get("required", []))
    rows = ["| field | type | required | description |", "|---|---|---|---|"]
    for name, prop in properties.items():
        rows.append(f"| `{name}` | {_type(prop)} | {'yes' if name in required else 'no'} | {_describe(prop)} |")
    return rows


def _operation(method: str, path: str, op: dict[str, Any], named: dict[str, Any]) -> list[str]:
    anchor = re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")
    lines = [f"### `{method.upper()} {path}` {{#{anchor}}}", ""]
    if op.get("summary"):
        lines += [f"**{op['summary']}.** " + _text(op.get("description", "")), ""]
    elif op.get("description"):
        lines += [_text(op["description"]), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for param in params:
            schema = param.get("schema", {})
            own = _cell(param.get("description", ""))
            described = " ".join(w for w in (own, _describe({**schema, "description": ""})) if w) or _describe(schema)
            lines.append(
                f"| `{param['name']}` | {param['in']} | {_type(schema)} | "
                f"{'yes' if param.get('required') else 'no'} | {described} |"
            )
        lines.append("")
    body = op.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            schema = content.get("schema", {})
            name = schema.get("$ref", "").rsplit("/", 1)[-1]
            if name.startswith("Body_"):  # a form's fields: shown here, not among the schemas
                lines += [f"Request body (`{media}`):", "", *_properties_table(named[name]), ""]
            else:
                lines += [f"Request body (`{media}`): {_type(schema)}.", ""]
    responses = op.get("responses", {})
    if responses:
        items = []
        for code, response in responses.items():
            refs = [c["schema"] for c in response.get("content", {}).values() if c.get("schema", {}).get("$ref")]
            if any(ref["$ref"] == _VALIDATION for ref in refs):
                items.append(f"`{code}` `invalid_request` in the service's error form {_ERROR_FORM}")
                continue
            shown = f" ({', '.join(_type(ref) for ref in refs)})" if refs else ""
            items.append(f"`{code}` {response.get('description', '')}{shown}")
        lines += ["Responses: " + "; ".join(items) + ".", ""]
    return lines


def _group(path: str) -> str:
    for title, prefixes in _GROUPS:
        if path.startswith(prefixes):
            return title
    return _OWN


def render_reference(schema: dict[str, Any]) -> str:
    """The Markdown of the reference: the endpoints by group, then the named schemas."""
    named = schema.get("components", {}).get("schemas", {})
    groups: dict[str, list[str]] = {_OWN: [], **{title: [] for title, _ in _GROUPS}}
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            groups[_group(path)] += _operation(method, path, op, named)
    info = schema.get("info", {})
    lines = [
        f"Generated from OpenAPI {schema.get('openapi', '')} schema of {info.get('title', '')} "
        f"{info.get('version', '')}; the schema itself: [{SCHEMA_FILE}]({SCHEMA_FILE}). Every error, a request "
        f"that does not validate included, is answered in the service's one error form {_ERROR_FORM}.",
        "",
    ]
    for title, body in groups.items():
        if body:
            lines += [f"## {title}", "", *body]
    listed = {n: s for n, s in named.items() if not n.startswith("Body_") and n not in _NOT_LISTED}
    if listed:
        lines += ["## Schemas", ""]
        for name, item in listed.items():
            lines += [f"### {name} {{#{_anchor(name)}}}", ""]
            if item.get("description"):
                lines += [_text(item["description"]), ""]
            table = _properties_table(item)
            lines += [*table, ""] if table else [f"Type: {_type(item)}.", ""]
    return "\n".join(lines)


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, SCHEMA_FILE, content=json.dumps(openapi_schema(), indent=2) + "\n"))
    return files


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_reference(openapi_schema()))
