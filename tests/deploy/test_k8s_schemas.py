"""Every kustomization under deploy/k8s renders without warnings, and every object it renders validates
against the official Kubernetes JSON schemas (strict: unknown fields are errors) of the versions we support."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.deploy.k8s import CRD_KINDS, K8S, K8S_VERSIONS, RENDERINGS

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (it ships the schemas; test extra)"
)


def test_every_kustomization_and_component_is_rendered():
    """A new overlay or component cannot escape the tests: each one is in RENDERINGS."""
    rendered_dirs = {directory for directory, _ in RENDERINGS.values()}
    rendered_components = {c for _, components in RENDERINGS.values() for c in components}
    for path in sorted(K8S.rglob("kustomization.yaml")):
        rel = str(path.parent.relative_to(K8S))
        kind = yaml.safe_load(path.read_text()).get("kind", "Kustomization")
        if rel == "base":
            continue  # not deployable alone (no image, no backend); every overlay renders it
        if kind == "Component":
            assert rel in rendered_components, f"component {rel} is not rendered by the tests"
        else:
            assert rel in rendered_dirs, f"kustomization {rel} is not rendered by the tests"


def test_render_without_warnings(renderings):
    for name, r in renderings.items():
        assert r.objects, f"{name} rendered nothing"
        # Deprecated fields (bases, patchesStrategicMerge, commonLabels, ...) print warnings here.
        assert not r.stderr.strip(), f"kustomize warned while rendering {name}:\n{r.stderr}"


def test_renderings_hold_the_expected_objects(renderings):
    server_kinds = {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for name in ("gpu", "cpu"):
        assert {o["kind"] for o in renderings[name].objects} == server_kinds, name
    assert {o["kind"] for o in renderings["convert"].objects} == {"Job", "ConfigMap", "NetworkPolicy", "ServiceAccount"}
    assert {o["kind"] for o in renderings["production"].objects} == server_kinds | {
        "PodMonitor",
        "PrometheusRule",
        "HorizontalPodAutoscaler",
        "Certificate",
    }
    for r in renderings.values():
        assert {o["metadata"].get("namespace") for o in r.objects} == {"colibri"}, r.name


def _unique_objects(renderings) -> list[dict]:
    """Each distinct object once (the overlays share most of the base): validation loads big schemas."""
    seen: dict[str, dict] = {}
    for r in renderings.values():
        for obj in r.objects:
            seen.setdefault(json.dumps(obj, sort_keys=True), obj)
    return list(seen.values())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_official_schemas(renderings, version):
    checked, skipped = 0, set()
    for obj in _unique_objects(renderings):
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_KINDS:
            skipped.add(key)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.absolute_path)
            pytest.fail(
                f"{obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: "
                f"{e.message} (at {path or 'the top level'})"
            )
        checked += 1
    assert checked >= 10
    assert skipped == CRD_KINDS, "every CRD kind is rendered somewhere, and only those are skipped"


def test_crd_kinds_really_have_no_bundled_schema():
    """The explicit skips are needed: kubernetes-validate knows none of the CRD kinds."""
    for api_version, kind in sorted(CRD_KINDS):
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(
                {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}}, K8S_VERSIONS[-1], strict=True
            )
