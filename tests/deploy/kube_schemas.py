"""Kubernetes manifests checked as the API server would take them, for a given Kubernetes version.

The schemas are the strict ones kubernetes-validate ships per minor version (generated from each
release's OpenAPI document; strict: an unknown field is an error, as with server-side field
validation). They carry types, required fields and closed objects, not the API server's own rules,
so a few of those that the chart's values can break are checked beside them (names, labels,
selectors, port names, a Recreate strategy without rollingUpdate).

The ServiceMonitor is a Prometheus Operator custom resource, in no Kubernetes schema: its metadata
and label selector are checked against Kubernetes' definitions of those types, and its spec
against the monitoring.coreos.com/v1 fields the chart writes (SERVICE_MONITOR below, closed: a
field the chart starts writing is added there, with the operator's API reference at hand).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
from kubernetes_validate import utils as kubernetes_validate
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from referencing import Registry, Resource

_DEFINITIONS = "https://kubernetes.io/api/_definitions.json#/$defs/"
#: Prometheus' duration syntax (the operator's Duration type).
_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
#: The operator's SecretKeySelector (a key of a Secret in the monitor's namespace).
_SECRET_KEY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string", "minLength": 1},
                   "optional": {"type": "boolean"}},
}
#: The operator's TLSConfig of an endpoint, the fields the chart writes (the CA from a Secret).
_TLS_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "ca": {"type": "object", "additionalProperties": False, "properties": {"secret": _SECRET_KEY}},
        "serverName": {"type": "string"},
        "insecureSkipVerify": {"type": "boolean"},
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "targetPort": {"type": ["integer", "string"]},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": {"type": "string", "pattern": _DURATION},
        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
        "honorLabels": {"type": "boolean"},
        "tlsConfig": _TLS_CONFIG,
    },
}
SERVICE_MONITOR: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://monitoring.coreos.com/servicemonitor/v1",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"$ref": _DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector"],
            "properties": {
                "selector": {"$ref": _DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {"type": "array", "items": _ENDPOINT},
                "jobLabel": {"type": "string"},
            },
        },
    },
}
#: Custom resources the chart renders, by (apiVersion, kind): what they are checked against.
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def supported_versions(kube_version: str) -> list[str]:
    """Minor versions ("1.25") kubernetes-validate has schemas for that a Chart.yaml kubeVersion
    constraint (">=1.25.0-0": Helm's form, the -0 admitting pre-releases) allows, oldest first."""
    spec = SpecifierSet(re.sub(r"-0\b", "", kube_version).replace(" ", ","))
    minors = {kubernetes_validate.major_minor(v) for v in kubernetes_validate.all_versions()}
    return sorted((m for m in minors if spec.contains(Version(f"{m}.0"), prereleases=True)), key=Version)


def _schema_dir(version: str) -> str:
    return f"kubernetes-json-schema/v{version}.0-local-strict"


@functools.cache
def _registry(version: str) -> Registry:
    """Kubernetes' type definitions of one minor version (read once: 2 MB of JSON)."""
    definitions = kubernetes_validate.schema_contents(f"{_schema_dir(version)}/_definitions.json", version)
    return Resource.from_contents(definitions) @ Registry()


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    schema = CUSTOM_RESOURCES.get((api_version, kind))
    if schema is None:
        # kubernetes-validate's file names: the group without its domain, e.g. policy/v1 -> policy-v1.
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        try:
            schema = kubernetes_validate.schema_contents(
                f"{_schema_dir(version)}/{kind.lower()}-{group_version}.json", version)
        except FileNotFoundError:
            return None
    return jsonschema.Draft202012Validator(schema, registry=Resource.from_contents(schema) @ _registry(version))


def definition_fields(version: str, definition: str) -> set[str]:
    """Field names of one of Kubernetes' types ("io.k8s.api.core.v1.PodSecurityContext")."""
    resolved = _registry(version).resolver().lookup(_DEFINITIONS + definition)
    return set(resolved.contents["properties"])


def _where(path: Any) -> str:
    return ".".join(str(p) for p in path) or "(top)"


def schema_errors(manifest: dict[str, Any], version: str) -> list[str]:
    """What the schema of the manifest's kind in Kubernetes ``version`` ("1.33") finds wrong."""
    validator = _validator(version, manifest.get("apiVersion", ""), manifest.get("kind", ""))
    if validator is None:
        return [f"{manifest.get('apiVersion')} {manifest.get('kind')} is not served by Kubernetes {version}"]
    return [f"{_where(e.absolute_path)}: {e.message}" for e in validator.iter_errors(manifest)]


def _label_errors(where: str, labels: dict[str, Any]) -> Iterator[str]:
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 \
                or not _LABEL_NAME.match(name):
            yield f"{where}: label key {key!r} is not a qualified name"
        if value and (len(str(value)) > 63 or not _LABEL_NAME.match(str(value))):
            yield f"{where}: label value {value!r} of {key!r} is not a valid label value"


def _pod_errors(pod: dict[str, Any]) -> Iterator[str]:
    for container in pod["spec"].get("containers", []):
        for port in container.get("ports", []):
            name = port.get("name", "")
            if name and (len(name) > 15 or not _PORT_NAME.match(name) or "--" in name):
                yield f"spec.template.spec.containers.{container['name']}.ports: {name!r} is no port name"


def server_rule_errors(manifest: dict[str, Any]) -> list[str]:
    """API server rules that no schema carries, of those the chart's values can break."""
    errors: list[str] = []
    meta = manifest.get("metadata", {})
    name = meta.get("name", "")
    if len(name) > 63 or not _DNS_LABEL.match(name):
        errors.append(f"metadata.name: {name!r} is not a DNS-1123 label")
    errors += _label_errors("metadata.labels", meta.get("labels"))
    if manifest.get("kind") == "Deployment":
        spec = manifest["spec"]
        strategy = spec.get("strategy", {})
        if strategy.get("type") == "Recreate" and strategy.get("rollingUpdate") is not None:
            errors.append("spec.strategy.rollingUpdate: may not be specified when strategy type is 'Recreate'")
        template_labels = spec["template"]["metadata"].get("labels", {})
        errors += _label_errors("spec.template.metadata.labels", template_labels)
        selected = spec["selector"].get("matchLabels", {})
        if any(template_labels.get(k) != v for k, v in selected.items()):
            errors.append("spec.template.metadata.labels: the selector does not match the template's labels")
        errors += _pod_errors(spec["template"])
    return errors


def manifest_errors(manifest: dict[str, Any], version: str) -> list[str]:
    """Everything found wrong with one manifest for Kubernetes ``version``, each as 'kind/name: where: what'."""
    found = schema_errors(manifest, version) + server_rule_errors(manifest)
    who = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
    return [f"{who}: {error}" for error in found]
