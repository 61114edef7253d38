"""Test doubles for the master: a tiny tokenizer, a live master on loopback, and fake nodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import uvicorn
import websockets
from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect

from master.config import MasterSettings
from master.node_frames import NodeFrameProtocol
from master.server import create_app
from pd_cluster import protocol
from pd_cluster.kv_spec import KVSpec
from pd_cluster.node.master_proof import prove_to_master

CLUSTER_TOKEN = "cluster-secret-for-tests"
ADMIN_TOKEN = "admin-secret-for-tests"
MODEL = "tiny-llama"
CONTEXT = 256
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHAT_MESSAGES = [{"role": "user", "content": "hello"}]

_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:;<>|/_-'\"\n"


def tiny_tokenizer() -> Any:
    """A character-level fast tokenizer with a simple chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in _CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return hf


def write_model_dir(root: Path, max_position_embeddings: int = CONTEXT) -> Path:
    """A model directory with only config.json: enough for the master to know the model."""
    path = root / MODEL
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_settings(model_dir: Path | None = None, **overrides: Any) -> MasterSettings:
    values: dict[str, Any] = {
        "cluster_token": CLUSTER_TOKEN,
        "admin_token": ADMIN_TOKEN,
        "model": str(model_dir) if model_dir is not None else "default",
        "heartbeat_timeout_s": 2.0,
        "queue_timeout_s": 2.0,
        "request_timeout_s": 20.0,
        # The P -> D path, whatever the prompt's length; tests of local prefill set their threshold.
        "local_prefill_max_tokens": 0,
    }
    values.update(overrides)
    return MasterSettings(**values)


def kv_spec(**overrides: Any) -> KVSpec:
    values: dict[str, Any] = {
        "model": MODEL, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "block_size": 4,
    }
    values.update(overrides)
    return KVSpec(**values)


def register_msg(node_id: str, role: str, **overrides: Any) -> protocol.Register:
    values: dict[str, Any] = {
        "node_id": node_id,
        "role": role,
        "model": MODEL,
        "kv_spec": kv_spec(),
        "data_address": f"127.0.0.1:{abs(hash(node_id)) % 20000 + 30000}" if role == "decode" else None,
        "capacity": protocol.NodeCapacity(max_total_tokens=4096, max_running_requests=8, max_model_len=CONTEXT),
    }
    values.update(overrides)
    return protocol.Register(**values)


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class LiveMaster:
    """The master app served by uvicorn on a free loopback port, inside the test's event loop."""

    def __init__(self, settings: MasterSettings, tokenizer: Any = None) -> None:
        self.app = create_app(settings, tokenizer=tokenizer if tokenizer is not None else tiny_tokenizer())
        self.ctx = self.app.state.ctx
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}{protocol.NODE_WS_PATH}"
        # The master's own websocket protocol: nodes' frames applied as they are read.
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="on", ws_max_size=protocol.MAX_MESSAGE_BYTES + 65536,
            ws=NodeFrameProtocol,
        )
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None
        self.http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "LiveMaster":
        self._task = asyncio.create_task(self.server.serve(sockets=[self._sock]))
        await wait_until(lambda: self.server.started or self._task.done(), 10.0, "uvicorn to start")
        assert self.server.started, "uvicorn did not start"
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=15.0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.http is not None:
            await self.http.aclose()
        self.server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10.0)
            except asyncio.TimeoutError:
                self.server.force_exit = True
                self._task.cancel()
        self._sock.close()

    async def nodes(self) -> dict[str, dict[str, Any]]:
        assert self.http is not None
        response = await self.http.get("/admin/nodes", headers=ADMIN_HEADERS)
        assert response.status_code == 200, response.text
        return {n["id"]: n for n in response.json()["data"]}


class FakeNode:
    """A node that speaks the control protocol; the test drives what it answers.

    A fake prefill node warms its channels at once: from each ``DecodePeers`` on, its status
    reports every listed decode node in ``warm_peers`` (``auto_warm=False``: the test sets
    :attr:`warm_peers` itself; None sends ``status`` as it is)."""

    def __init__(
        self, master: LiveMaster, node_id: str, role: str, token: str | None = CLUSTER_TOKEN,
        auto_warm: bool = True, **register: Any,
    ) -> None:
        self.master = master
        self.register = register_msg(node_id, role, **register)
        self.token = token
        self.status = protocol.NodeStatus(
            free_kv_tokens=self.register.capacity.max_total_tokens,
            total_kv_tokens=self.register.capacity.max_total_tokens,
        )
        self.heartbeat = True
        self.ws: ClientConnection | None = None
        self.jobs: asyncio.Queue[protocol.PrefillJob] = asyncio.Queue()
        self.aborts: list[str] = []
        self.drains = 0
        #: Roles the master asked this node to take (SetRole), in order.
        self.set_roles: list[str] = []
        self.auto_warm = auto_warm and role == "prefill"
        #: The last DecodePeers the master sent (decode node id -> data address).
        self.decode_peers: dict[str, str] | None = None
        #: Sent as the status's warm_peers when not None.
        self.warm_peers: list[str] | None = None
        self.closed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def node_id(self) -> str:
        return self.register.node_id

    async def open(self) -> ClientConnection:
        """Connect and, with a token, prove it as a node does (raises MasterRefusedProof when the
        master cannot prove the same token); without one the socket is left as it connected."""
        self.ws = await connect(self.master.ws_url, max_size=2 * protocol.MAX_MESSAGE_BYTES)
        if self.token is not None:
            await prove_to_master(self.ws, self.token, self.node_id)
        return self.ws

    async def join(self) -> BaseModel:
        """Connect and register; returns the master's answer (Registered or Refused)."""
        ws = await self.open()
        await ws.send(protocol.encode(self.register))
        reply = protocol.parse_master_message(await asyncio.wait_for(ws.recv(), 5.0))
        if isinstance(reply, protocol.Registered):
            self._tasks.append(asyncio.create_task(self._heartbeat()))
            self._tasks.append(asyncio.create_task(self._reader()))
        return reply

    async def send(self, message: BaseModel | str) -> None:
        assert self.ws is not None
        await self.ws.send(message if isinstance(message, str) else protocol.encode(message))

    async def next_job(self, timeout: float = 5.0) -> protocol.PrefillJob:
        return await asyncio.wait_for(self.jobs.get(), timeout)

    def current_status(self) -> protocol.NodeStatus:
        if self.warm_peers is None:
            return self.status
        return self.status.model_copy(update={"warm_peers": list(self.warm_peers)})

    async def _heartbeat(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                if self.heartbeat:
                    await self.send(self.current_status())
                await asyncio.sleep(0.05)

    async def _reader(self) -> None:
        assert self.ws is not None
        try:
            async for frame in self.ws:
                msg = protocol.parse_master_message(frame)
                if isinstance(msg, protocol.PrefillJob):
                    self.jobs.put_nowait(msg)
                elif isinstance(msg, protocol.Abort):
                    self.aborts.append(msg.request_id)
                elif isinstance(msg, protocol.Drain):
                    self.drains += 1
                elif isinstance(msg, protocol.SetRole):
                    self.set_roles.append(msg.role)
                elif isinstance(msg, protocol.DecodePeers):
                    self.decode_peers = {p.node_id: p.data_address for p in msg.peers}
                    if self.auto_warm:
                        self.warm_peers = sorted(self.decode_peers)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(), 2.0)
        self.closed.set()


async def wait_warm(master: LiveMaster, pairs: int = 1, timeout: float = 5.0) -> None:
    """Wait until the master counts ``pairs`` warm (P, D) pairs."""
    await wait_until(lambda: master.ctx.registry.warm_pairs() >= pairs, timeout, f"{pairs} warm pair(s)")


async def serve_one(
    prefill: FakeNode,
    decode: FakeNode,
    tokens: list[tuple[int, str]],
    job: protocol.PrefillJob | None = None,
    finish_reason: str = "stop",
    **first_token: Any,
) -> protocol.PrefillJob:
    """Answer the next job of ``prefill`` like a real pair: FirstToken from P, the rest from D."""
    job = job if job is not None else await prefill.next_job()
    (first_id, first_text), rest = tokens[0], tokens[1:]
    await prefill.send(
        protocol.FirstToken(
            request_id=job.request_id, token_id=first_id, text=first_text,
            finish_reason=None if rest else finish_reason, **first_token,
        )
    )
    for i, (token_id, text) in enumerate(rest):
        last = i == len(rest) - 1
        await decode.send(
            protocol.TokenDelta(
                request_id=job.request_id, token_ids=[token_id], text=text,
                finish_reason=finish_reason if last else None,
            )
        )
    return job
