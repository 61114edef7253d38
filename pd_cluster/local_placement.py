"""Where ``pd-cluster local`` puts its nodes, decided before any of them starts.

With two or more GPUs the nodes are spread over them round-robin (prefill nodes first), each node
seeing only its GPU through ``CUDA_VISIBLE_DEVICES``. Nodes that share a GPU get an explicit
``--gpu-memory-fraction``: the launcher measures the GPU's free memory once, before any node
starts, and splits it evenly, so no node sizes its KV pool from memory another node is about to
take. :func:`plan_placement` is that decision as a pure function; a tensor-parallel node takes
whole GPUs of its own (:func:`plan_tp_placement`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("pd_cluster.local")

GiB = 2**30
MiB = 2**20
#: What a node process holds on its GPU outside torch's allocator (CUDA context, communicator and
#: kernel buffers): invisible to ``torch.cuda.memory_reserved``, so the launcher keeps it out of the fraction.
NODE_CONTEXT_BYTES = 1 * GiB
#: The engine's headroom for activations and CUDA graphs (``engine_setup.GPU_HEADROOM_BYTES``).
ENGINE_HEADROOM_BYTES = 768 * MiB
#: A shared GPU must leave at least this much KV per node.
MIN_KV_BYTES = 64 * MiB


class PlacementError(ValueError):
    """The nodes cannot be placed as asked; the message says why and what to change."""


@dataclass(frozen=True)
class GPUMemory:
    free: int
    total: int


@dataclass(frozen=True)
class NodePlacement:
    name: str
    role: str
    gpu: int | None = None  # CUDA ordinal as the launcher sees it; None: CPU
    memory_fraction: float | None = None  # of the GPU's total memory; None: the node sizes itself
    kv_bytes: int | None = None  # the KV memory this plan leaves the node on a shared GPU
    shared_by: int = 1  # nodes on this GPU
    #: Tensor parallel: the node's GPUs (``gpu`` is the first), a whole set no other node uses.
    tp_gpus: tuple[int, ...] = ()
    tp: int = 1


def node_roles(prefill: int, decode: int, mixed: int = 0) -> list[str]:
    return ["prefill"] * prefill + ["decode"] * decode + ["mixed"] * mixed


def _node_names(roles: Sequence[str]) -> list[str]:
    counters: dict[str, int] = {}
    names = []
    for role in roles:
        index = counters.get(role, 0)
        counters[role] = index + 1
        names.append(f"{role}-{index}")
    return names


def plan_tp_placement(roles: Sequence[str], gpus: Sequence[int], tps: Sequence[int]) -> list[NodePlacement]:
    """Place nodes of which some are tensor parallel: each node takes ``tp`` whole GPUs of
    ``gpus`` in order, none shared (on CPU, ``gpus`` empty: each node runs its ``tp`` processes)."""
    names = _node_names(roles)
    if not gpus:
        return [NodePlacement(name, role, tp=tp) for name, role, tp in zip(names, roles, tps)]
    if sum(tps) > len(gpus):
        raise PlacementError(f"the nodes' tensor parallelism needs {sum(tps)} GPUs ({' + '.join(map(str, tps))}) "
                             f"but {len(gpus)} are given; use fewer nodes, a smaller --*-tp or more GPUs (--gpus)")
    placements, first = [], 0
    for name, role, tp in zip(names, roles, tps):
        own = tuple(gpus[first:first + tp])
        placements.append(NodePlacement(name, role, own[0], tp_gpus=own, tp=tp))
        first += tp
    return placements


def plan_placement(roles: Sequence[str], gpus: Mapping[int, GPUMemory], weight_bytes: int) -> list[NodePlacement]:
    """Place nodes (named ``<role>-<i>``) round-robin over ``gpus`` (empty: every node on CPU).

    A node alone on its GPU sizes its KV pool itself (a fraction of what is free when it starts).
    The ``k`` nodes sharing a GPU split its free memory evenly: each may use ``free / k`` less its
    CUDA context, i.e. its weights, the engine's headroom and the rest as KV, given as a fraction
    of the GPU's total memory (what ``--gpu-memory-fraction`` takes).
    """
    names = _node_names(roles)
    if not gpus:
        return [NodePlacement(name, role) for name, role in zip(names, roles)]
    ids = list(gpus)
    assigned = [ids[i % len(ids)] for i in range(len(roles))]
    sharing = {gpu: assigned.count(gpu) for gpu in ids}
    placements = []
    for name, role, gpu in zip(names, roles, assigned):
        k = sharing[gpu]
        if k == 1:
            placements.append(NodePlacement(name, role, gpu))
            continue
        memory = gpus[gpu]
        share = memory.free // k
        kv_bytes = share - NODE_CONTEXT_BYTES - weight_bytes - ENGINE_HEADROOM_BYTES
        if kv_bytes < MIN_KV_BYTES:
            need = NODE_CONTEXT_BYTES + weight_bytes + ENGINE_HEADROOM_BYTES + MIN_KV_BYTES
            raise PlacementError(
                f"GPU {gpu} has {memory.free / GiB:.1f} GiB free: too little for {k} nodes "
                f"(each needs ~{need / GiB:.1f} GiB: {weight_bytes / GiB:.1f} GiB of weights, CUDA context, "
                f"headroom and some KV); use fewer nodes, more GPUs (--gpus) or a smaller model"
            )
        fraction = int((share - NODE_CONTEXT_BYTES) / memory.total * 10_000) / 10_000  # round down
        placements.append(NodePlacement(name, role, gpu, fraction, kv_bytes, k))
    return placements


def choose_gpus(device: str, requested: Sequence[int] | None, visible: int) -> list[int]:
    """The CUDA ordinals the nodes may use ([]: CPU) for ``--device`` and ``--gpus``."""
    name = device.strip().lower()
    if name == "cpu":
        if requested:
            raise PlacementError("--gpus places nodes on GPUs: it does not go with --device cpu")
        return []
    if name.startswith("cuda:"):
        index = name.removeprefix("cuda:")
        if not index.isdigit():
            raise PlacementError(f"--device {device!r} is not cuda:N")
        if requested and list(requested) != [int(index)]:
            raise PlacementError(f"--device {device} and --gpus {','.join(map(str, requested))} disagree")
        requested = [int(index)]
    elif name not in ("auto", "cuda"):
        raise PlacementError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if visible == 0:
        if name == "auto" and not requested:
            return []
        raise PlacementError(f"--device {device}: no CUDA device is visible")
    chosen = list(requested) if requested else list(range(visible))
    wrong = [i for i in chosen if not 0 <= i < visible]
    if wrong:
        raise PlacementError(f"GPU {wrong[0]} is not visible here ({visible} GPU(s): 0..{visible - 1})")
    if len(set(chosen)) != len(chosen):
        raise PlacementError("--gpus lists a GPU twice")
    return chosen


_GPU_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(json.dumps([list(torch.cuda.mem_get_info(i)) for i in range(n)]))\n"
)


def probe_gpus(timeout: float = 180.0) -> list[GPUMemory]:
    """Free and total memory of each visible GPU, measured by a short-lived process so that the
    launcher holds no CUDA context (memory the nodes could not use for as long as it runs)."""
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=timeout,
                             check=True, stdin=subprocess.DEVNULL).stdout
        return [GPUMemory(free=int(free), total=int(total)) for free, total in json.loads(out.splitlines()[-1])]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        logger.warning("could not measure the GPUs (%s): treating this machine as having none", e)
        return []


def visible_device_ids(count: int) -> list[str]:
    """What to put in a child's ``CUDA_VISIBLE_DEVICES`` for each ordinal this process sees."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    return [entry.strip() for entry in given.split(",") if entry.strip()][:count]


def model_weight_bytes(model_dir: Path) -> int:
    """The model's size from its safetensors files (an upper bound when served in a narrower dtype)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def format_placement_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ("NODE", "ROLE", "GPU", "MEM FRACTION", "KV SLOTS", "PID")
    cells = [header] + [tuple(str(row.get(key.lower().replace(" ", "_"), "-")) for key in header) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells) + "\n"


def default_roles(num_gpus: int) -> tuple[int, int, int]:
    """(prefill, decode, mixed) nodes when none are asked for. On one GPU, one mixed node: a prefill
    and a decode node sharing it serve 0.75x the requests a second of one mixed node at saturation
    (8B shape, 1024 in / 128 out, one H200; docs/benchmarks), since a split leaves one side idle
    while the other queues. Elsewhere (CPU, several GPUs), one prefill and one decode node."""
    return (0, 0, 1) if num_gpus == 1 else (1, 1, 0)
