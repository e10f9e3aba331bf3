"""Fixtures for the deployment tests: every kustomization rendered once per session."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.deploy.k8s import RENDERINGS, Rendering, kustomize_command, render


@pytest.fixture(scope="session")
def renderings(tmp_path_factory) -> dict[str, Rendering]:
    command = kustomize_command()
    if command is None:
        pytest.skip(
            "neither kubectl (>= 1.27, with kustomize v5 built in) nor a standalone kustomize is on PATH: "
            "cannot render deploy/k8s"
        )
    scratch = tmp_path_factory.mktemp("kustomize")
    with ThreadPoolExecutor(max_workers=len(RENDERINGS)) as pool:
        results = pool.map(lambda name: render(command, name, scratch), RENDERINGS)
    return {r.name: r for r in results}
