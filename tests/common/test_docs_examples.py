"""The examples in README.md and docs/ run as written: every grpcurl body parses as its method's request message,
every curl body to the OpenAI-compatible API passes the router's request parser, and every config-file snippet of
docs/configuration.md loads with the config loader into its sections' settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2  # noqa: F401 (registers grpc.health.v1 in the default pool)

import common.pb  # noqa: F401 (registers the Colibri services in the default pool)
from common.config import load_config_file, resolve
from expert_service.engine.config import EngineConfig
from expert_service.serving.main import WorkerConfig
from router_service.config import RouterConfig
from router_service.openai_request import parse_request

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# One command: its words (and quoted ones) up to the end of a line not continued with a backslash; its body
# -d '{...}' may span lines (a shell single-quoted string holds no quote); grpcurl's method is package.Service/Method.
WORDS = r"(?:[^`'\n\\]|\\\n|'[^'\n]*')*?"
GRPCURL = re.compile(rf"\bgrpcurl\b{WORDS}-d '([^']*)'{WORDS}\s([a-z][\w.]*\.[A-Z]\w*)/(\w+)")
CURL = re.compile(rf"\bcurl\b{WORDS}(/v1/[\w/]+){WORDS}-d '([^']*)'")
CURL_POST = re.compile(rf"(\bcurl\b{WORDS})-d '")  # a curl command up to its body
SECTIONS = {"router": RouterConfig, "worker": WorkerConfig, "engine": EngineConfig}


def code_blocks(doc: Path, languages: tuple[str, ...]) -> list[str]:
    """The fenced code blocks of `doc` in these languages (indented fences, in list items, included)."""
    blocks: list[str] = []
    language, lines = None, []
    for line in doc.read_text().splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence:
            if language in languages:
                blocks.append("\n".join(lines) + "\n")
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def examples(pattern: re.Pattern) -> list:
    found = []
    for doc in DOCS:
        for block in code_blocks(doc, ("sh", "bash", "console", "")):
            found += [pytest.param(*m.groups(), id=f"{doc.name}:{m.group(0)[:40]}") for m in pattern.finditer(block)]
    return found


@pytest.mark.parametrize("body, service, method", examples(GRPCURL))
def test_grpcurl_bodies_are_their_methods_requests(body, service, method):
    pool = descriptor_pool.Default()
    request_type = pool.FindServiceByName(service).FindMethodByName(method).input_type
    json_format.Parse(body, message_factory.GetMessageClass(request_type)())  # an unknown field fails here


@pytest.mark.parametrize("path, body", examples(CURL))
def test_curl_bodies_pass_the_openai_parser(path, body):
    kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}[path]
    parsed = json.loads(body)
    parse_request(parsed, kind, parsed.get("model", "default-model"))


@pytest.mark.parametrize("command", examples(CURL_POST))
def test_curl_posts_say_their_body_is_json(command):
    """curl -d labels its body application/x-www-form-urlencoded, a type the HTTP front refuses (a browser posts it
    across sites unasked): every example sends the JSON header."""
    assert re.search(r"-H '[Cc]ontent-[Tt]ype: application/json'", command), command


def test_the_examples_are_found():
    assert len(examples(GRPCURL)) >= 8 and len(examples(CURL)) >= 4


def config_snippets() -> list[str]:
    blocks = code_blocks(REPO / "docs" / "configuration.md", ("yaml", "yml"))
    return [block for block in blocks if re.search(r"^(router|worker|engine):", block, re.M)]


def test_configuration_snippets_load(tmp_path):
    snippets = config_snippets()
    assert snippets, "docs/configuration.md: no config file snippet"
    for i, snippet in enumerate(snippets):
        path = tmp_path / f"colibri{i}.yaml"
        path.write_text(snippet)
        for section, cls in SECTIONS.items():
            flags = {"socket": "/tmp/w.sock"} if cls is WorkerConfig else None  # the worker needs a listener
            resolve(cls, file_values=load_config_file(path, section), env={}, flags=flags)


def colibri_commands() -> list:
    """(subcommand, its words) of every `colibri SUBCOMMAND ...` command in the docs' shell blocks and inline code."""
    from colibri.cli import SUBCOMMANDS

    lines = [
        (doc, line)
        for doc in DOCS
        for block in code_blocks(doc, ("sh", "bash", "console", ""))
        for line in block.replace("\\\n", " ").splitlines()
    ]
    for doc in DOCS:  # inline code in the prose, cli.md's headings included
        lines += [(doc, span) for span in re.findall(r"`((?:\.venv/bin/)?colibri [a-z][^`]*)`", doc.read_text())]
    found = []
    for doc, line in lines:
        for m in re.finditer(r"(?:^|[\s`$(])(?:\.venv/bin/)?colibri ([a-z-]+)\b([^`#|;&]*)", line):
            if m.group(1) in SUBCOMMANDS:
                found.append(
                    pytest.param(m.group(1), m.group(2), id=f"{doc.name}:colibri {m.group(1)}{m.group(2)[:30]}")
                )
    return found


@pytest.mark.parametrize("subcommand, words", colibri_commands())
def test_documented_colibri_flags_exist(subcommand, words, monkeypatch):
    import sys

    from colibri.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["colibri", subcommand])
    parser = build_parser()
    options = parser._subparsers._group_actions[0].choices[subcommand]._option_string_actions
    unknown = [flag for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", words) if flag not in options]
    assert not unknown, f"colibri {subcommand}: no such option {unknown}"
