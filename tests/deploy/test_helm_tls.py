"""TLS in the Helm chart: with tls.enabled every pod mounts the kubernetes.io/tls Secret and each
component gets the flags that put its links on TLS, which the CLI takes as they are rendered;
without it, none of them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from pd_cluster.cli import _node_settings, build_parser
from tests.deploy.test_helm_chart import NODE_ROLES, Helm, Release, helm  # noqa: F401 (the fixture)
from tests.tls_files import make_tls_files

pytestmark = pytest.mark.timeout(60)

MOUNT = "/etc/pd-cluster/tls"
TLS_FLAGS = {"--tls-cert", "--tls-key", "--tls-ca", "--data-tls", "--data-tls-name"}


def tls_values(**more: Any) -> dict[str, Any]:
    return {"tls": {"enabled": True, "secretName": "pd-tls", **more}, "mixed": {"replicas": 1},
            "monitoring": {"serviceMonitor": {"enabled": True}}}


def pod_of(release: Release, component: str) -> dict[str, Any]:
    return release.deployment(component)["spec"]["template"]["spec"]


def tls_volume(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in pod["volumes"] if "secret" in v]


def test_every_pod_mounts_the_secret_read_only(helm: Helm) -> None:  # noqa: F811
    release = helm.install(tls_values(), name="pd")
    for component in ("master", *NODE_ROLES):
        pod = pod_of(release, component)
        assert tls_volume(pod) == [{"name": "tls", "secret": {"secretName": "pd-tls", "defaultMode": 0o440}}]
        assert {"name": "tls", "mountPath": MOUNT, "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert pod_of(release, "master")["securityContext"]["fsGroup"] == 10001  # what reads the 0440 files


def test_the_master_serves_https_and_its_probes_and_scrapes_follow(helm: Helm) -> None:  # noqa: F811
    release = helm.install(tls_values(), name="pd")
    container = release.container("master")
    assert container["args"][-4:] == ["--tls-cert", f"{MOUNT}/tls.crt", "--tls-key", f"{MOUNT}/tls.key"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    (endpoint,) = release.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "pd-tls", "key": "ca.crt"}},
                                     "serverName": "pd-pd-cluster-control"}


def test_nodes_dial_https_check_the_ca_and_serve_their_data_plane_over_tls(helm: Helm) -> None:  # noqa: F811
    release = helm.install(tls_values(), name="pd")
    for role in NODE_ROLES:
        container = release.container(role)
        args = container["args"]
        assert args[2] == "https://pd-pd-cluster-control:8000"
        assert args[args.index("--tls-ca") + 1] == f"{MOUNT}/ca.crt"
        assert "--data-tls" in args
        # The node status server is plain HTTP whatever tls says: its probes stay as they are.
        assert all("scheme" not in container[p]["httpGet"] for p in ("readinessProbe", "livenessProbe"))
        if role == "prefill":  # it dials pod IPs, so it checks one name the certificate holds
            assert args[args.index("--data-tls-name") + 1] == "pd-pd-cluster-data"
            assert "--tls-cert" not in args
        else:
            assert args[args.index("--tls-cert") + 1] == f"{MOUNT}/tls.crt"
            assert args[args.index("--tls-key") + 1] == f"{MOUNT}/tls.key"
            assert "--data-tls-name" not in args


def test_notes_name_what_the_certificate_must_hold(helm: Helm) -> None:  # noqa: F811
    notes = helm.install(tls_values(), name="pd").notes
    assert "export PD_URL=https://localhost:8000" in notes
    for name in ("pd-pd-cluster-control", "pd-pd-cluster-data", "pd-pd-cluster.default.svc"):
        assert name in notes
    assert "jsonpath='{.data.ca\\.crt}'" in notes


def test_without_tls_nothing_of_it_is_rendered(helm: Helm) -> None:  # noqa: F811
    release = helm.install({"mixed": {"replicas": 1}, "monitoring": {"serviceMonitor": {"enabled": True}}}, name="pd")
    for component in ("master", *NODE_ROLES):
        pod = pod_of(release, component)
        container = pod["containers"][0]
        assert tls_volume(pod) == []
        assert TLS_FLAGS.isdisjoint(container["args"])
        assert all("scheme" not in container[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        if component != "master":
            assert container["args"][2].startswith("http://")
    assert "scheme" not in release.one("ServiceMonitor")["spec"]["endpoints"][0]
    assert "https://" not in release.notes


def test_the_cli_takes_the_rendered_flags_and_reads_the_mounted_files(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    files = make_tls_files(tmp_path)
    mount = tmp_path / "tls"  # the Secret's keys, as the kubelet lays them out
    mount.mkdir()
    for key, path in {"tls.crt": files.cert, "tls.key": files.key, "ca.crt": files.ca}.items():
        shutil.copy(path, mount / key)
    release = helm.install(tls_values(mountPath=str(mount)), name="pd")
    monkeypatch.setenv("PD_CLUSTER_TOKEN", "cluster-token-0123456789")

    master = build_parser().parse_args(release.container("master")["args"])
    assert (Path(master.tls_cert), Path(master.tls_key)) == (mount / "tls.crt", mount / "tls.key")
    for role in NODE_ROLES:
        settings = _node_settings(build_parser().parse_args(release.container(role)["args"]), role)
        assert settings.master_link_tls() is not None  # checks the master with ca.crt
        assert settings.data_plane_tls
        if role == "prefill":
            assert settings.data_tls_name == "pd-pd-cluster-data" and settings.data_dialer_tls() is not None
        else:
            assert settings.data_listener_tls() is not None
