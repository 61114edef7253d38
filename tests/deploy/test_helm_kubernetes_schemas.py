"""Every manifest the Helm chart renders is one Kubernetes takes, in every version the chart claims.

The defaults, each values example and values that turn every optional template on are rendered
once per module by Helm's engine (as in test_helm_chart.py), and each manifest is validated
(tests/deploy/kube_schemas.py) for every minor version from Chart.yaml's kubeVersion floor up to
the newest kubernetes-validate knows.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from pd_cluster.chart_values import value_key
from pd_cluster.engine_flags import PASSED_ON
from tests.deploy.kube_schemas import CUSTOM_RESOURCES, definition_fields, manifest_errors, supported_versions
from tests.deploy.test_helm_chart import CHART, EXAMPLES, NODE_ROLES, FakeKubeAPI, Helm, Release, load_example
from tests.engine_flags import sample_value

pytestmark = pytest.mark.timeout(120)

KUBE_VERSIONS = supported_versions(yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])

_PROBES = {"startup": {"initialDelaySeconds": 5, "periodSeconds": 10, "timeoutSeconds": 5, "successThreshold": 1,
                       "failureThreshold": 30}}
_PLACEMENT = {
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}},
    "podAnnotations": {"example.com/note": "on"},
    "podLabels": {"team": "serving"},
    "priorityClassName": "high",
}
_NODE = {
    **_PLACEMENT,
    "gpuMemoryFraction": 0.8,
    "terminationGracePeriodSeconds": 400,
    "extraArgs": ["--log-format", "json"],
    "extraEnv": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    "probes": _PROBES,
    "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}],
}
#: Every optional template and branch on: PVC model and cache claim, LoadBalancer, monitoring, budgets.
EVERY_FEATURE: dict[str, Any] = {
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccount": {"annotations": {"example.com/role": "none"}},
    "auth": {"clusterToken": "cluster-token-0123456789", "adminToken": "admin-token-0123456789"},
    "model": {"source": "pvc", "pvc": {"claimName": "llama", "subPath": "Llama-3-8B"},
              "cache": {"existingClaim": "pd-cache"}},
    "extraEnv": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    "engine": {value_key(flag): sample_value(flag) for flag in PASSED_ON},
    "master": {**_PLACEMENT, "extraArgs": ["--log-format", "json"], "extraEnv": [{"name": "A", "value": "1"}],
               "probes": _PROBES, "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"},
                                              "loadBalancerSourceRanges": ["10.0.0.0/8"]}},
    "prefill": {**_NODE, "strategy": {"type": "Recreate"}},
    "decode": {**_NODE, "tp": 2, "engine": {"maxNumBatchedTokens": 256}},
    "mixed": {**_NODE, "replicas": 1},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM serving"}}},
}
#: The other branches: host-path model, NodePort, an existing Secret, no ServiceAccount, CPU nodes, one master.
OTHER_BRANCHES: dict[str, Any] = {
    "fullnameOverride": "llm",
    "serviceAccount": {"create": False, "name": "serving"},
    "auth": {"existingSecret": "pd-tokens"},
    "model": {"source": "hostPath", "hostPath": {"path": "/data/models/llama"}},
    "master": {"replicas": 1, "service": {"type": "NodePort", "nodePort": 30080}},
    **{role: {"device": "cpu", "gpu": 0, "tp": 2, "replicas": 2} for role in NODE_ROLES},
}
RENDERS: dict[str, dict[str, Any]] = {
    "defaults": {},
    **{f"examples/{path.name}": load_example(path) for path in EXAMPLES},
    "every-feature": EVERY_FEATURE,
    "other-branches": OTHER_BRANCHES,
}
_SOURCE = re.compile(r"^# Source: pd-cluster/templates/(\S+)$", re.M)


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Release]]:
    api = FakeKubeAPI()
    api.start()
    helm = Helm(api, tmp_path_factory.mktemp("helm-home"))
    try:
        yield {name: helm.install(values, name="pd") for name, values in RENDERS.items()}
    finally:
        helm.close()
        api.stop()


def test_versions_span_the_chart_claim_up_to_the_newest_schemas() -> None:
    assert KUBE_VERSIONS[0] == "1.25"
    minors = [int(v.split(".")[1]) for v in KUBE_VERSIONS]
    assert minors == list(range(25, 25 + len(minors))) and minors[-1] >= 37


def test_renders_cover_every_template(releases: dict[str, Release]) -> None:
    rendered = {source for release in releases.values() for source in _SOURCE.findall(release.raw_manifest)}
    # validate.yaml renders nothing: it only fails a release on values the schema cannot judge.
    templates = {p.name for p in (CHART / "templates").glob("*.yaml")} - {"validate.yaml"}
    assert rendered == templates


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("render", list(RENDERS))
def test_rendered_manifests_are_valid_kubernetes_objects(releases: dict[str, Release], render: str, version: str) -> None:
    errors = [e for manifest in releases[render].manifests for e in manifest_errors(manifest, version)]
    assert errors == []


@pytest.mark.parametrize(("key", "definition"), [("podSecurityContext", "PodSecurityContext"),
                                                 ("securityContext", "SecurityContext")])
def test_security_context_values_take_the_fields_of_the_newest_kubernetes(key: str, definition: str) -> None:
    # values.schema.json closes these maps so that a misspelt field is refused at install.
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"][key]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == definition_fields(KUBE_VERSIONS[-1], f"io.k8s.api.core.v1.{definition}")


# --- The same validation on manifests with a fault in them --------------------------------------


def _deployment(releases: dict[str, Release]) -> dict[str, Any]:
    return copy.deepcopy(releases["defaults"].deployment("decode"))


def _broken(releases: dict[str, Release], fault: str) -> dict[str, Any]:
    manifest = _deployment(releases)
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    if fault == "unknown container field":
        container["imagePullPolicyy"] = "Always"
    elif fault == "unknown spec field":
        manifest["spec"]["replica"] = 3
    elif fault == "wrong type":
        manifest["spec"]["replicas"] = "two"
    elif fault == "missing container name":
        del container["name"]
    elif fault == "probe handler misspelt":
        container["readinessProbe"]["httpget"] = container["readinessProbe"].pop("httpGet")
    elif fault == "env value not a string":
        container["env"].append({"name": "N", "value": 1})
    elif fault == "bad label value":
        manifest["metadata"]["labels"]["team"] = "LLM serving"
    elif fault == "recreate with rolling update":
        manifest["spec"]["strategy"]["type"] = "Recreate"
    elif fault == "port name too long":
        container["ports"][0]["name"] = "status-of-the-node"
    elif fault == "selector off the template":
        manifest["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "prefill"
    return manifest


FAULTS = {
    "unknown container field": "imagePullPolicyy",
    "unknown spec field": "replica",
    "wrong type": "spec.replicas",
    "missing container name": "'name' is a required property",
    "probe handler misspelt": "httpget",
    "env value not a string": "value",
    "bad label value": "LLM serving",
    "recreate with rolling update": "Recreate",
    "port name too long": "status-of-the-node",
    "selector off the template": "selector",
}


@pytest.mark.parametrize("version", [KUBE_VERSIONS[0], KUBE_VERSIONS[-1]])
@pytest.mark.parametrize(("fault", "shown"), list(FAULTS.items()), ids=list(FAULTS))
def test_validation_catches_a_broken_manifest(releases: dict[str, Release], version: str, fault: str, shown: str) -> None:
    assert manifest_errors(_deployment(releases), version) == []
    errors = manifest_errors(_broken(releases, fault), version)
    assert errors and all(e.startswith("Deployment/pd-pd-cluster-decode: ") for e in errors)
    assert any(shown in e for e in errors), errors


def test_validation_catches_an_api_version_kubernetes_no_longer_serves(releases: dict[str, Release]) -> None:
    budget = copy.deepcopy(releases["every-feature"].one("PodDisruptionBudget", "-decode"))
    budget["apiVersion"] = "policy/v1beta1"  # removed in 1.25
    assert manifest_errors(budget, KUBE_VERSIONS[0]) == [
        f"PodDisruptionBudget/pd-pd-cluster-decode: policy/v1beta1 PodDisruptionBudget is not served by "
        f"Kubernetes {KUBE_VERSIONS[0]}"
    ]


def test_validation_catches_a_broken_service(releases: dict[str, Release]) -> None:
    service = copy.deepcopy(releases["defaults"].one("Service", "-control"))
    service["spec"]["ports"][0]["port"] = "http"
    service["spec"]["clusterIp"] = "None"
    errors = manifest_errors(service, KUBE_VERSIONS[-1])
    assert any("spec.ports.0.port" in e for e in errors), errors
    assert any("clusterIp" in e for e in errors), errors


@pytest.mark.parametrize(("fault", "shown"), [
    ("unknown endpoint field", "scrapeInterval"),
    ("bad interval", "15 seconds"),
    ("selector misspelt", "matchLabel"),
    ("unknown metadata field", "label"),
])
def test_validation_catches_a_broken_service_monitor(releases: dict[str, Release], fault: str, shown: str) -> None:
    monitor = copy.deepcopy(releases["every-feature"].one("ServiceMonitor"))
    assert (monitor["apiVersion"], monitor["kind"]) in CUSTOM_RESOURCES
    assert manifest_errors(monitor, KUBE_VERSIONS[-1]) == []
    endpoint = monitor["spec"]["endpoints"][0]
    if fault == "unknown endpoint field":
        endpoint["scrapeInterval"] = endpoint.pop("interval")
    elif fault == "bad interval":
        endpoint["interval"] = "15 seconds"
    elif fault == "selector misspelt":
        monitor["spec"]["selector"]["matchLabel"] = monitor["spec"]["selector"].pop("matchLabels")
    else:
        monitor["metadata"]["label"] = monitor["metadata"].pop("labels")
    errors = manifest_errors(monitor, KUBE_VERSIONS[-1])
    assert any(shown in e for e in errors), errors
