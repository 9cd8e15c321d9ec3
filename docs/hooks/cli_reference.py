"""MkDocs hook: the command-line reference, generated from mineru-fast's own argument parser.

A page holding the line ``<!-- generated: cli-reference -->`` gets, in its place, the ``--help``
text of ``mineru-fast`` and of each subcommand in the order the parser defines them, as argparse
formats it (``mineru_fast.cli.main.build_argparser``). Nothing is run and no model is loaded.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- generated: cli-reference -->"
WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the page does not depend on the terminal


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in definition order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def _help(parser: argparse.ArgumentParser) -> str:
    saved = {name: os.environ.get(name) for name in ("COLUMNS", "NO_COLOR")}
    os.environ["COLUMNS"], os.environ["NO_COLOR"] = WIDTH, "1"
    try:
        return parser.format_help().rstrip()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _fenced(text: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}text\n{text}\n{fence}"


def render_reference() -> str:
    """The Markdown of the reference: the top-level help, then one section per subcommand."""
    from mineru_fast.cli.main import build_argparser

    parser = build_argparser()
    parts = ["### `mineru-fast`", "", _fenced(_help(parser))]
    for name, summary, sub in _subcommands(parser):
        parts += ["", f"### `mineru-fast {name}`", ""]
        if summary:
            parts += [summary[:1].upper() + summary[1:] + ".", ""]
        parts.append(_fenced(_help(sub)))
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_reference())
