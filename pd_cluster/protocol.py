"""Control-plane messages between the master and its nodes (websocket, JSON text frames).

Every message is a pydantic model with a literal ``type``; :func:`parse_message` turns a frame
into the right model and rejects unknown or malformed ones. The cluster token never crosses the
link: the first three frames prove both ends hold it (:class:`LinkHello`, :class:`LinkChallenge`,
:class:`LinkProof`, see :mod:`pd_cluster.cluster_proof`), the master first; then ``Register``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from pd_cluster.cluster_proof import NodeId, Nonce, Proof, Transcript
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.kv_spec import KVSpec

#: Largest control frame either side accepts (a prompt of ~100k token ids fits).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Websocket path on the master's HTTP address where nodes dial in.
NODE_WS_PATH = "/internal/nodes/ws"
#: Seconds between status reports; the master drops a node after several missed ones.
STATUS_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 5.0

#: ``mixed``: one engine that prefills and decodes; the master routes whole requests to it.
Role = Literal["prefill", "decode", "mixed"]
FinishReason = Literal["stop", "length", "abort", "error"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenLogprob(BaseModel):
    """Logprob of the chosen token and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = Field(default_factory=dict)


class PromptLogprobs(BaseModel):
    """Logprobs of a prompt's tokens after its first, each given the tokens before it (entry ``i``
    is token ``i + 1``'s), from the raw logits; with the top ``k`` alternatives when asked
    (``SamplingParams.prompt_logprobs``). Parallel lists: a long prompt's entries stay compact."""

    logprobs: list[float]
    #: Each token's rank among the vocabulary at its position (1: the most likely).
    ranks: list[int] = Field(default_factory=list)
    top_ids: list[list[int]] = Field(default_factory=list)
    top_logprobs: list[list[float]] = Field(default_factory=list)


# ---- proof of the cluster token, both ways, before Register ----------------------------


class LinkHello(_Message):
    """Node -> master, first frame: who dials, and the node's nonce."""

    type: Literal["link.hello"] = "link.hello"
    node_id: NodeId
    nonce: Nonce


class LinkChallenge(_Message):
    """Master -> node: the master's id and nonce, and its proof of the cluster token."""

    type: Literal["link.challenge"] = "link.challenge"
    master_id: NodeId
    nonce: Nonce
    proof: Proof


class LinkProof(_Message):
    """Node -> master, once the master proved itself: the node's proof."""

    type: Literal["link.proof"] = "link.proof"
    proof: Proof


def link_transcript(hello: LinkHello, master_id: str, master_nonce: str) -> Transcript:
    """What both proofs of one node link are bound to (the node dials, the master listens)."""
    return Transcript("master-link", hello.node_id, master_id, hello.nonce, master_nonce)


# ---- node -> master ---------------------------------------------------------------------


class NodeCapacity(BaseModel):
    max_total_tokens: int = Field(gt=0, description="KV slots in the node's pool")
    max_running_requests: int = Field(gt=0)
    max_model_len: int = Field(gt=0)


class Register(_Message):
    type: Literal["register"] = "register"
    node_id: str = Field(min_length=1, max_length=128)
    role: Role
    model: str
    kv_spec: KVSpec
    data_address: str | None = Field(default=None, description="host:port of a D's data plane")
    capacity: NodeCapacity
    device: str = "cpu"


class NodeStatus(_Message):
    """Periodic load report (also the heartbeat)."""

    type: Literal["status"] = "status"
    running: int = 0
    waiting: int = 0
    free_kv_tokens: int = 0
    total_kv_tokens: int = 0
    evictable_kv_tokens: int = 0
    queued_prefill_tokens: int = Field(
        default=0, description="prompt tokens accepted and not yet prefilled (P: its jobs; D or mixed: local prefills)"
    )
    generation_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = Field(
        default=0.0, ge=0, description="measured prefill rate: prompt tokens per second of the steps that ran them "
        "(0: not measured yet); the master prices a prefill on this node with it",
    )
    decode_step_base_s: float = Field(
        default=0.0, ge=0, description="measured decode step time, the part that does not grow with the batch "
        "(with decode_step_per_request_s: step = base + per_request * rows; both 0: not measured yet)",
    )
    decode_step_per_request_s: float = Field(default=0.0, ge=0, description="what each running request adds")
    prefix_hit_tokens: int = Field(default=0, description="cumulative prompt tokens served from cache")
    prompt_tokens: int = Field(default=0, description="cumulative prompt tokens seen")
    draining: bool = False
    switching_to: Role | None = Field(
        default=None, description="the role the node is changing to (it takes no new work until it has)"
    )
    warm_peers: list[str] = Field(
        default_factory=list,
        description="P: ids of the decode nodes it holds a live, warmed data-plane channel to (the master "
        "routes to those pairs first); D: ids of the prefill nodes that warmed a channel to it",
    )
    channel_setup_s: float | None = Field(
        default=None, ge=0, description="P: seconds its last data-plane channel took to form and warm"
    )
    request_ids: list[str] = Field(
        default_factory=list,
        description="ids of the requests the node holds now (P: jobs; D: reserved or decoding); a master "
        "aborts those it has already ended, so a node that was cut off drops stale work when it returns",
    )


class KVEvents(_Message):
    """Blocks that entered or left a node's prefix cache, as chained block hashes."""

    type: Literal["kv_events"] = "kv_events"
    stored: list[int] = Field(default_factory=list)
    evicted: list[int] = Field(default_factory=list)
    cleared: bool = False


class FirstToken(_Message):
    """P -> master: the prefill finished and its first token was sampled."""

    type: Literal["first_token"] = "first_token"
    request_id: str
    token_id: int
    text: str = ""
    logprob: TokenLogprob | None = None
    #: The prompt's logprobs, when the job asked for them (``SamplingParams.prompt_logprobs``).
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: FinishReason | None = None
    cached_tokens_prefill: int = 0
    hit_blocks_decode: int = 0
    transfer_bytes: int = 0
    node_ttft_s: float | None = Field(
        default=None, ge=0, description="seconds from the node taking the job to this token leaving it"
    )
    prefix_query_s: float | None = Field(
        default=None, ge=0, description="of node_ttft_s: the prefix query to the decode node, asked to answered"
    )
    prefill_s: float | None = Field(
        default=None, ge=0, description="of node_ttft_s: the prompt queued on the node's engine to its first token"
    )


class BeamOutput(BaseModel):
    """One beam of a finished beam search: its tokens, their text, its cumulative logprob and
    length-penalized score (the ranking key), why it ended and, when asked, its tokens' logprobs."""

    token_ids: list[int]
    text: str = ""
    cum_logprob: float
    score: float
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None


class TokenDelta(_Message):
    """D -> master: new tokens of a running request; the last one carries finish_reason."""

    type: Literal["token_delta"] = "token_delta"
    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    #: First delta of a request the node prefilled itself, when it asked: the prompt's logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: FinishReason | None = None
    cached_tokens: int | None = Field(
        default=None, ge=0, description="first delta of a request the node prefilled itself (GenerateJob): "
        "prompt tokens its prefix cache held",
    )
    node_ttft_s: float | None = Field(
        default=None, ge=0, description="first delta of a request the node prefilled itself: seconds from the node "
        "taking the job to this delta leaving it",
    )
    beams: list[BeamOutput] | None = Field(
        default=None, description="a beam search's only delta (it carries finish_reason): its best beams, best "
        "first; token_ids, text and logprobs are the best beam's",
    )


class TokenDeltas(_Message):
    """D -> master: one engine step's ``TokenDelta``s, every request's in one frame.

    A step emits a token for each running request; one frame for all of them is one socket
    read and one parse on the master instead of one a request. A request's deltas keep their
    order within the frame and across frames; :func:`encode_frames` splits a batch that would
    exceed ``MAX_MESSAGE_BYTES``.
    """

    type: Literal["token_deltas"] = "token_deltas"
    deltas: list[TokenDelta] = Field(min_length=1)


class RequestFailed(_Message):
    """A node could not serve a request; ``retryable`` says another node may."""

    type: Literal["request_failed"] = "request_failed"
    request_id: str
    message: str
    retryable: bool = True
    busy: bool = Field(
        default=False, description="the decode node had no room for it (backpressure, not a fault): the master "
        "queues the request again, in its place, without counting an attempt",
    )
    peer_lost: bool = Field(
        default=False, description="the fault is the attempt's other node: a prefill node lost its connection to "
        "the decode node (the master re-runs the request away from that decode node and keeps routing off it until "
        "it reports again), or a decode node's lease ran out before the prefill node handed the request over (the "
        "re-run avoids that prefill node and may keep the decode node)",
    )


class KVTransferred(_Message):
    """P -> master: the KV of a request reached its decode node (after FirstToken)."""

    type: Literal["kv_transferred"] = "kv_transferred"
    request_id: str
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)


class Drained(_Message):
    """The node finished all its work after a drain and is about to leave."""

    type: Literal["drained"] = "drained"


# ---- master -> node ---------------------------------------------------------------------


class RoleChanged(_Message):
    """Node -> master: the node now serves as ``info.role``, with that role's registration (its data
    address, capacity); its engine, KV pool and prefix cache are the ones it had. Answers
    ``SetRole``; a switch that failed answers with the old role and ``failed`` saying why."""

    type: Literal["role_changed"] = "role_changed"
    info: Register
    failed: str | None = None


class Registered(_Message):
    type: Literal["registered"] = "registered"
    node_id: str
    master_id: str | None = Field(
        default=None, description="this master process's id; the ids of the requests it sends carry it, so a "
        "node that loses the link drops that master's requests (the master has re-run them elsewhere)",
    )
    masters: list[str] = Field(
        default_factory=list, description="a master of several worker processes, dialled on its public address: "
        "every worker's own URL; the node links to each of them instead (each worker routes its own clients' "
        "requests)",
    )


class Refused(_Message):
    type: Literal["refused"] = "refused"
    reason: str
    retryable: bool = Field(
        default=False,
        description="True when the same registration may succeed later (its node id is still held by an "
        "older connection the master has not yet dropped); False for a node that does not fit the cluster",
    )


class PrefillJob(_Message):
    """Master -> P: prefill these tokens and hand the request to the named D."""

    type: Literal["prefill_job"] = "prefill_job"
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    decode_node_id: str
    decode_address: str
    deadline_s: float = Field(gt=0, description="seconds the node may spend on it")
    client_request_id: str | None = Field(
        default=None, description="the client's X-Request-Id, for the node's log (the request's own id is request_id)"
    )


class GenerateJob(_Message):
    """Master -> D or mixed node: prefill the prompt here (only what the prefix cache lacks, in
    chunks between decode steps) and decode it; every token, the first included, comes back as
    ``TokenDelta``s."""

    type: Literal["generate_job"] = "generate_job"
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    deadline_s: float = Field(gt=0, description="seconds the node may spend on it")
    client_request_id: str | None = Field(
        default=None, description="the client's X-Request-Id, for the node's log (the request's own id is request_id)"
    )


class Abort(_Message):
    type: Literal["abort"] = "abort"
    request_id: str


class Drain(_Message):
    """Stop taking work, finish what is running, then leave."""

    type: Literal["drain"] = "drain"


class SetRole(_Message):
    """Master -> node: serve as ``role`` from now on. The node takes no new work meanwhile, finishes
    what its old role holds (prefills end, streams decode to their end), keeps its engine and
    answers ``RoleChanged``."""

    type: Literal["set_role"] = "set_role"
    role: Role


class DecodePeer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str
    data_address: str = Field(min_length=1, description="host:port of its data plane")


class DecodePeers(_Message):
    """Master -> P: the decode nodes that take new work now (the whole list, not a change).

    Sent right after ``Registered`` and whenever a decode node joins, drains or leaves. P forms
    and warms a data-plane channel to each (up to its channel bound) in the background, closes
    the ones to nodes no longer listed, and reports the warmed ones in ``NodeStatus.warm_peers``.
    """

    type: Literal["decode_peers"] = "decode_peers"
    peers: list[DecodePeer] = Field(default_factory=list)


NodeMessage = Annotated[
    Union[
        Register, NodeStatus, KVEvents, FirstToken, TokenDelta, TokenDeltas, RequestFailed, KVTransferred, Drained,
        RoleChanged,
    ],
    Field(discriminator="type"),
]
MasterMessage = Annotated[
    Union[Registered, Refused, PrefillJob, GenerateJob, Abort, Drain, DecodePeers, SetRole],
    Field(discriminator="type"),
]

_node_adapter: TypeAdapter = TypeAdapter(NodeMessage)
_master_adapter: TypeAdapter = TypeAdapter(MasterMessage)


class MessageTooLarge(ValueError):
    pass


def _check_size(frame: str | bytes) -> None:
    if len(frame) > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")


def parse_node_message(frame: str | bytes) -> BaseModel:
    """Decode a frame a node sent; raises ValueError on anything unknown or malformed."""
    _check_size(frame)
    return _node_adapter.validate_json(frame)


def parse_master_message(frame: str | bytes) -> BaseModel:
    """Decode a frame the master sent; raises ValueError on anything unknown or malformed."""
    _check_size(frame)
    return _master_adapter.validate_json(frame)


def encode(message: BaseModel) -> str:
    return message.model_dump_json()


def encode_frames(message: BaseModel) -> list[str]:
    """``message`` as the frames to send: one, except a ``TokenDeltas`` too large for one frame,
    which goes as several (halves, in order) so that no frame exceeds ``MAX_MESSAGE_BYTES``."""
    frame = message.model_dump_json()
    if len(frame) <= MAX_MESSAGE_BYTES or not isinstance(message, TokenDeltas) or len(message.deltas) < 2:
        return [frame]
    half = len(message.deltas) // 2
    return [*encode_frames(TokenDeltas(deltas=message.deltas[:half])),
            *encode_frames(TokenDeltas(deltas=message.deltas[half:]))]
