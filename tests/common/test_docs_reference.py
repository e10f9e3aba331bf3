"""The reference tables of docs/ match the code: docs/observability.md's metric tables are what RouterMetrics and
WorkerMetrics export (name, type, attribute), docs/cli.md's exit codes are common/errors.py's classes, and every
environment variable the code reads is documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from common import errors
from common.metrics import RouterMetrics, WorkerMetrics, new_registry

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def table_rows(doc: Path, heading: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first table under the heading that starts with `heading`."""
    rows: list[list[str]] = []
    inside = False
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            if rows:
                break
            inside = line.lstrip("#").strip().startswith(heading)
        elif inside and line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:]  # the header row


def exported(metrics_cls) -> dict[str, tuple[str, str]]:
    """name: (type, attribute) of what `metrics_cls` registers, as a scrape names it (counters end in _total)."""
    registry = new_registry(process_metrics=False)
    metrics = metrics_cls(registry, "m")
    by_collector = {}
    for attribute, value in vars(metrics).items():
        collector = getattr(value, "_metric", value)  # a labelled family wraps its metric
        collector = getattr(collector, "_parent", None) or collector
        by_collector[id(collector)] = attribute
    out = {}
    for collector, names in registry._collector_to_names.items():
        family = next(iter(collector.collect()))
        name = family.name + ("_total" if family.type == "counter" else "")
        attribute = by_collector.get(id(collector), "")
        if not attribute:  # an unlabelled metric is held as its one child
            attribute = next((a for a, v in vars(metrics).items() if getattr(v, "_name", None) in names), "")
        out[name] = (family.type, attribute)
    return out


@pytest.mark.parametrize("heading, cls", [("Router (", RouterMetrics), ("Worker (", WorkerMetrics)])
def test_observability_tables_are_the_exported_metrics(heading, cls):
    rows = table_rows(DOCS / "observability.md", heading)
    documented = {row[0].strip("`"): (row[1], row[-1].strip("`")) for row in rows}
    assert documented, f"docs/observability.md: no metric table under {heading!r}"
    assert documented == exported(cls)


def test_cli_exit_codes_are_the_error_classes():
    rows = table_rows(DOCS / "cli.md", "Exit codes")
    documented = {name: int(row[0]) for row in rows if row[0].isdigit() for name in re.findall(r"`(\w+)`", row[1])}
    classes = {
        name: cls.exit_code
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.ColibriError)
    }
    assert documented == classes


CODE_DIRS = ("colibri", "common", "router_service", "expert_service")
# Set by Colibri for libraries it loads, never read as a setting.
INTERNAL_ENV = {"NUMBA_CACHE_DIR", "PYTHONPATH"}


def test_every_environment_variable_the_code_reads_is_documented():
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *DOCS.glob("*.md")])
    names = set()
    for directory in CODE_DIRS:
        for path in (REPO / directory).rglob("*.py"):
            if "/pb/" in str(path):
                continue
            names |= set(re.findall(r"[\"']((?:COLIBRI|OTEL|LOG|GRPC)_[A-Z0-9_]+)[\"']", path.read_text()))
    missing = sorted(n for n in names - INTERNAL_ENV if not re.search(rf"\b{n}\b", docs))
    assert not missing, f"environment variables the code reads that no doc names: {missing}"


def test_docs_cite_no_issue_numbers_or_private_paths():
    """The docs stand on their own: no tracker numbers or private paths (another project's "vLLM PR #37190", a
    source, is fine)."""
    for doc in [REPO / "README.md", *DOCS.glob("*.md")]:
        text = doc.read_text()
        for pattern in (r"\bSPEC\b", r"\.\./shared", r"(?<![\w&/])(?<!PR )#\d{2,}\b", r"\b[Ii]ssue \d+"):
            assert not re.search(pattern, text), f"{doc.name}: {re.search(pattern, text).group(0)!r}"
