"""The step loop: schedule -> run the model -> sample -> update requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.default_model import resolve_model_path
from pd_cluster.engine.grammar import Grammars
from pd_cluster.engine.kv_pool import KVPool, torch_dtype
from pd_cluster.engine.launch_timing import LaunchTimer, StepMarks
from pd_cluster.engine.length_predictor import OutputLengthPredictor
from pd_cluster.engine.mapped_ids import MappedIds
from pd_cluster.engine.model_runner import ModelRunner, StepHook
from pd_cluster.engine.output_processor import OutputProcessor
from pd_cluster.engine.outputs import EngineStats, TokenUpdate
from pd_cluster.engine.penalties import PenaltyBook, has_penalties
from pd_cluster.engine.radix_cache import RadixCache
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import PENDING, Request, RequestStatus
from pd_cluster.engine.sampler import (
    DeviceSample,
    GraphDrawn,
    SampledToken,
    SamplingState,
    fetch,
    sample_on_device,
)
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.engine.scheduler import ScheduledStep, Scheduler
from pd_cluster.kv_spec import KVSpec
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.llama import LlamaModel
from pd_cluster.model.weights import load_weights
from pd_cluster.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384
#: Activations and CUDA graphs, kept out of the KV pool (an 8B-shape engine's 39 step graphs take
#: about 270 MiB, a 2048-token eager prefill about 300 MiB more).
GPU_HEADROOM_BYTES = 768 * 2**20
#: More of it for the side stream's prefill graphs (their own buffers and memory pool).
SIDE_GRAPHS_HEADROOM_BYTES = 256 * 2**20
KVEventSink = Callable[[list[int], list[int]], None]


def eos_token_ids(model_config: ModelConfig, tokenizer, path: Path) -> set[int]:
    ids = set(model_config.eos_token_ids)
    generation = path / "generation_config.json"
    if generation.is_file():
        import json

        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


@dataclass
class _InFlight:
    """A pipelined step's sampled ids still on the device, and where each goes: request ``i``'s
    output holds :data:`PENDING` at ``positions[i]`` until they are read back."""

    requests: list[Request]
    positions: list[int]
    #: Each request's row in ``result`` (rows of requests that ended meanwhile are skipped).
    rows: list[int]
    result: DeviceSample
    #: The sampling states of all of ``result``'s rows, in row order.
    states: list[SamplingState]
    #: Events around the step's kernels (late launch's timing), if kept.
    marks: StepMarks | None = None


@dataclass
class _Aside:
    """A request prefilled on the side stream beside the step in flight, its first token not read
    back yet; it joins the decode batch once it is."""

    request: Request
    result: DeviceSample
    #: KV slots it took, counted against admission until it joins the batch.
    held: int


#: Requests prefilled on the side stream at once, at most.
MAX_ASIDE = 4


class LLMEngine:
    """One model, one KV pool, one prefix cache, and the requests running on them."""

    def __init__(
        self, config: EngineConfig, *, tokenizer=None, load_tokenizer_from_model: bool = True,
        kv_event_sink: KVEventSink | None = None,
    ) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_path(self.model_path)
        device_name = config.resolved_device()
        self.device = torch.device(device_name)
        self.dtype_name = config.resolved_dtype(device_name)
        dtype = torch_dtype(self.dtype_name)
        if tokenizer is None and load_tokenizer_from_model:
            tokenizer = load_tokenizer(self.model_path)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(self.model_config, tokenizer, self.model_path)
        self.grammars = Grammars(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

        weights = load_weights(self.model_path, self.model_config, dtype, self.device)
        self.model = LlamaModel(self.model_config, weights, self.device, fused_rows=config.fused_decode_rows)
        self.kv_spec = KVSpec(
            model=self.model_config.name,
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype_name,
            block_size=config.block_size,
        )
        num_slots = config.max_total_tokens or self._default_kv_tokens()
        # CUDA graphs take one extra slot for their padding rows; the configured count stays usable.
        extra = 1 if (config.cuda_graphs and self.device.type == "cuda") else 0
        self.pool = KVPool(self.kv_spec, num_slots + extra, self.device)
        self.cache = RadixCache(
            self.pool, block_size=config.block_size, enabled=config.enable_prefix_cache, event_sink=kv_event_sink
        )
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.table = ReqSlotTable(config.max_running_requests, self.max_model_len + 1, self.device)
        self.predictor = OutputLengthPredictor()
        self.scheduler = Scheduler(config, self.pool, self.cache, self.table, self.predictor)
        self.runner = ModelRunner(self.model, self.pool, self.table, self.device, config)
        if config.prefill_chunk_tokens is None and self.runner.graphs is not None and config.graph_prefill_tokens():
            # Prefill in chunks that replay the mixed graphs rather than in one eager step.
            self.scheduler.prefill_chunk_tokens = max(config.graph_prefill_tokens())
        self._layer_hooks: StepHook | None = None
        self.penalties = PenaltyBook(self.model_config.vocab_size, self.device)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        #: Overlap scheduling: tokens accepted by id, not yet detokenized (request, token, first).
        self._deferred: list[tuple[Request, SampledToken, bool]] = []
        #: Overlap scheduling: the step launched last, its tokens not yet read back.
        self._in_flight: _InFlight | None = None
        #: Prefills started on the side stream (:meth:`add_request` with ``prefill_now``).
        self._aside: list[_Aside] = []
        self._side_stream = (torch.cuda.Stream(self.device, priority=-1)
                             if self.device.type == "cuda" and config.side_prefill_max_tokens > 0 else None)
        #: KV slots and request rows freed up to the last pipelined launch (the step in flight may
        #: still write those freed after it).
        self._frees_at_launch: tuple[int, int] | None = None
        #: Late launch (``config.late_launch``): step times, and the step that has the device now.
        self._launch_timer = LaunchTimer() if self.device.type == "cuda" and config.late_launch else None
        self._running_since = 0.0
        self._running_key: int | None = None
        #: The launch time last handed out (:meth:`launch_deadline`), until the launch it was for.
        self._deadline: float | None = None
        logger.info(
            "engine ready: model %s on %s (%s), %d KV slots (%.1f MiB), block size %d, prefix cache %s",
            self.model_config.name, self.device, self.dtype_name, num_slots,
            num_slots * self.kv_spec.bytes_per_token / 2**20, config.block_size,
            "on" if config.enable_prefix_cache else "off",
        )

    def _default_kv_tokens(self) -> int:
        """KV slots when none are configured. With ``gpu_memory_fraction`` (engines sharing a GPU) the
        pool is that share of the GPU's total memory less what this process already holds (its
        weights) and the headroom, capped by what is free; otherwise a fraction of the free memory."""
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        headroom = GPU_HEADROOM_BYTES
        if self.config.cuda_graphs and self.config.side_prefill_max_tokens > 0:
            headroom += SIDE_GRAPHS_HEADROOM_BYTES
        fraction = self.config.gpu_memory_fraction
        if fraction is None:
            budget = int(free * self.config.kv_memory_fraction) - headroom
        else:
            # Reserved, not just allocated: the allocator's cached blocks are this process's too.
            held = torch.cuda.memory_reserved(self.device)
            budget = min(int(fraction * total) - held, free) - headroom
        return max(budget // self.kv_spec.bytes_per_token, 1024)

    # ---- requests --------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request can never run on this engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}"
            )
        if n + params.max_tokens > self.pool.capacity:
            raise ValueError(
                f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the KV pool "
                f"({self.pool.capacity} tokens)"
            )
        if params.structured is not None:
            self.grammars.matcher(params.structured)  # compiled once, cached: a bad spec raises here

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        state = SamplingState.create(params, list(prompt_token_ids))
        output = OutputProcessor(self.tokenizer, params, self.eos_token_ids, list(prompt_token_ids))
        return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=state, output=output,
                       grammar=self.grammars.state(params, prompt_token_ids))

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        hold_kv: bool = False, prefill_only: bool = False, prefill_now: bool = False, whole_prefill: bool = False,
    ) -> Request:
        """Queue a request. ``prefill_only`` stops it after its first token; with ``hold_kv``
        its KV stays allocated until :meth:`release` (a prefill node sends it first).
        ``prefill_now``: where it is safe, prefill it at once on a side stream, beside the
        pipelined step in flight, instead of in the step after that one (see :meth:`_prefill_aside`).
        ``whole_prefill``: not in graph-sized chunks (:attr:`Request.whole_prefill`)."""
        req = self.make_request(request_id, prompt_token_ids, params)
        req.hold_kv = hold_kv
        req.prefill_only = prefill_only
        req.whole_prefill = whole_prefill
        self.requests[request_id] = req
        self.stats.prompt_tokens += len(prompt_token_ids)
        if prefill_now:
            self.stats.prefill_now_requests += 1
        if not (prefill_now and not hold_kv and not prefill_only and self._prefill_aside(req)):
            self.scheduler.add(req)
        return req

    def _prefill_aside(self, req: Request) -> bool:
        """Prefill a new request now on the side stream, while the pipelined step in flight runs;
        its first token is read back with that step's and it joins the next batch. A short miss
        (a later turn prefilled where it decodes) then waits for no decode step at all, where
        the batch would take it two steps later: one in flight, then its own.

        Safe only with nothing freed since that step's launch: the step may still write the KV
        slots or read the request rows freed after it (a request found finished as it ran), and
        this prefill takes free ones. Requests with penalties or a grammar, whose state the
        batch's sampling updates, and misses above ``side_prefill_max_tokens`` join the batch as
        usual. Returns whether it started."""
        config = self.config
        sched = self.scheduler
        if (self._side_stream is None or self._in_flight is None or len(self._aside) >= MAX_ASIDE
                or self._frees_at_launch != (self.pool.frees, self.table.frees)
                or req.grammar is not None or has_penalties(req.sampling.params)
                or len(sched.running) + len(self._aside) >= config.max_running_requests
                or self.table.num_free_rows == 0):
            return False
        n = req.num_tokens
        match = self.cache.match_prefix(req.token_ids(0, n))
        block = self.cache.block_size
        usable = min(match.num_tokens, ((n - 1) // block) * block)
        miss = n - usable
        if miss > min(config.side_prefill_max_tokens, config.max_num_batched_tokens):
            return False
        if sched.running and not sched.fits(n, sched.predicted_left(req.sampling.params, 0)):
            return False
        self.cache.inc_ref(match.node)
        slots = sched.alloc_slots(miss)
        if slots is None:
            self.cache.dec_ref(match.node)
            return False
        row = self.table.alloc_row()
        assert row is not None  # checked above
        req.row, req.prefix_node, req.num_computed = row, match.node, usable
        req.num_cached_tokens, req.admitted_once = usable, True
        req.status = RequestStatus.RUNNING
        step = ScheduledStep()
        step.add(req, miss, slots, sample=True)
        with torch.cuda.stream(self._side_stream):
            if usable:
                self.table.write(row, 0, match.slots[:usable])
            logits = self.runner.run(step, side=True)
            result = sample_on_device(logits, [req.sampling], self.penalties)
        req.num_computed = n
        sched.external_held += miss
        self.stats.computed_tokens += miss
        self.stats.side_prefills += 1
        if self.stats.side_prefills & (self.stats.side_prefills - 1) == 0:  # 1, 2, 4, 8, ...: a trace, not a flood
            logger.info("%d of %d requests asked to prefill at once did so on the side stream",
                        self.stats.side_prefills, self.stats.prefill_now_requests)
        self._aside.append(_Aside(req, result, miss))
        return True

    def _collect_aside(self, block: bool) -> None:
        """Read back the side prefills that are done (``block``: wait for all of them), accept
        their first tokens and join them to the batch; free those aborted meanwhile."""
        if not self._aside:
            return
        waiting: list[_Aside] = []
        now = time.monotonic()
        for entry in self._aside:
            ready = entry.result.ready
            if not block and ready is not None and not ready.query():
                waiting.append(entry)
                continue
            [tok] = fetch(entry.result, [entry.request.sampling])
            self.scheduler.external_held -= entry.held
            req = entry.request
            if req.finished:  # aborted while its prefill ran: its KV is free to go now
                self.scheduler.release_kv(req)
                continue
            self.scheduler.add_running(req)
            self._accept_id(req, tok, now)
        self._aside = waiting

    def settle_freed_slots(self) -> None:
        """Before free KV slots go to a writer outside this engine's stream (KV arriving from a
        prefill node): those freed since the pipelined step in flight was launched (a request
        found finished as it ran; its slots freed or cached without waiting for the device) may
        still be written by that step, so wait for it. Nothing to wait for otherwise."""
        if self._frees_at_launch is None or self._frees_at_launch == (self.pool.frees, self.table.frees):
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._frees_at_launch = (self.pool.frees, self.table.frees)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.finish_reason = "abort"
        req.hold_kv = False
        if any(entry.request is req for entry in self._aside):
            # Its prefill may still write its KV slots: they are freed once it is read back.
            self.penalties.release(req.sampling)
            req.status = RequestStatus.FINISHED
            return True
        self._drop_pending(req)
        self.scheduler.remove(req)
        self.penalties.release(req.sampling)
        req.status = RequestStatus.FINISHED
        return True

    def release(self, req: Request) -> None:
        """Free the KV a finished ``hold_kv`` request kept (into the prefix cache)."""
        self.scheduler.release_kv(req)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or bool(self._deferred) or self._in_flight is not None
                or bool(self._aside))

    # ---- the loop --------------------------------------------------------------------------

    def set_layer_hook_factory(self, factory: StepHook | None) -> None:
        """Before each step's forward, ``factory(step)`` may return a hook called after each
        layer's KV is stored (a prefill node streams its prompts' KV that way); None: no hooks."""
        self._layer_hooks = factory

    @property
    def pipelined(self) -> bool:
        """Whether steps are pipelined (``config.overlap_schedule``; by default on CUDA devices)."""
        flag = self.config.overlap_schedule
        return self.device.type == "cuda" if flag is None else flag

    def step(self) -> list[TokenUpdate]:
        if self.pipelined:
            if self._can_pipeline():
                return self._step_pipelined()
            self._read_back_in_flight()
            self._collect_aside(block=True)
            return self._step_overlapped()
        step = self.scheduler.schedule()
        if not step.requests:
            return []
        logits = self.runner.run(step, self._layer_hooks)
        argmax, drawn, mapped = self.runner.last_argmax, self.runner.last_drawn, self.runner.last_mapped
        self.stats.steps += 1
        self.stats.computed_tokens += step.num_tokens
        sampling_reqs = [r for r, s in zip(step.requests, step.samples) if s]
        for req, q_len in zip(step.requests, step.q_lens):
            req.num_computed += q_len
        updates: list[TokenUpdate] = []
        if not sampling_reqs:
            return updates
        self.grammars.apply_masks(logits, sampling_reqs)
        tokens = fetch(self._sample(logits, argmax, drawn, sampling_reqs, mapped), [r.sampling for r in sampling_reqs])
        now = time.monotonic()
        for req, tok in zip(sampling_reqs, tokens):
            updates.append(self._accept(req, tok.token_id, tok.logprob, now))
        return updates

    def _step_overlapped(self) -> list[TokenUpdate]:
        """One step with the host's per-token work moved off the device's critical path: this
        step's forward and sampling are launched first, then the previous step's tokens are
        detokenized and checked for stop strings while the device runs, then this step's ids are
        copied and accepted by id (EOS, stop ids and the length limit end a request at once).

        A stop string found in the previous step's text ends its request one step late: the token
        this step drew for it is dropped, and its KV slot is freed with the request's others.
        Updates come one call later than without overlap; :meth:`has_unfinished` stays true
        until they are out."""
        step = self.scheduler.schedule()
        launched = None
        if step.requests:
            logits = self.runner.run(step, self._layer_hooks)
            argmax, drawn, mapped = self.runner.last_argmax, self.runner.last_drawn, self.runner.last_mapped
            self.stats.steps += 1
            self.stats.computed_tokens += step.num_tokens
            sampling_reqs = [r for r, s in zip(step.requests, step.samples) if s]
            for req, q_len in zip(step.requests, step.q_lens):
                req.num_computed += q_len
            if sampling_reqs:
                self.grammars.apply_masks(logits, sampling_reqs)
                launched = (sampling_reqs, self._sample(logits, argmax, drawn, sampling_reqs, mapped))
        updates = self._detokenize_deferred()
        if launched is not None:
            sampling_reqs, result = launched
            tokens = fetch(result, [r.sampling for r in sampling_reqs])
            now = time.monotonic()
            for req, tok in zip(sampling_reqs, tokens):
                if req.finished:  # a stop string in its previous token's text ended it
                    self.stats.dropped_tokens += 1
                    continue
                self._accept_id(req, tok, now)
        return updates

    def _can_pipeline(self) -> bool:
        """Whether the next step may launch before the last one's tokens are read back: not while
        a layer hook streams KV (a prefill node), nor with a prefill-only or held request (whose
        end a prefill node acts on at once)."""
        if self._layer_hooks is not None:
            return False
        sched = self.scheduler
        return not any(r.prefill_only or r.hold_kv for queue in (sched.running, sched.waiting) for r in queue)

    def _step_pipelined(self) -> list[TokenUpdate]:
        """One step of overlap scheduling, the device never waiting on the host:

        1. this step is scheduled and its forward launched while the previous step may still run;
           rows whose input is the previous step's token take it on the device (the host holds
           :data:`PENDING` in its place);
        2. the previous step's tokens are read back (the forward keeps the device busy) and
           accepted: EOS, stop ids and the length limit end a request at once, and what this
           step computes for it is dropped;
        3. grammar masks for this step are filled (the previous tokens are in their matchers),
           and its sampling is launched;
        4. the tokens read back are detokenized; a stop string found there ends its request one
           step late, dropping the token this step draws for it and freeing its KV slot.

        Updates come one call later than without overlap; :meth:`has_unfinished` stays true until
        they are out."""
        previous = self._in_flight
        self._in_flight = None
        timer = self._launch_timer
        began = time.monotonic()
        step = self.scheduler.schedule()
        logits = None
        marks = None
        if step.requests:
            device_tokens = previous.result.tokens if previous is not None else None
            if timer is not None and timer.wants(step.num_tokens):
                marks = timer.begin(step.num_tokens, self.device)
            logits = self.runner.run(step, None, device_tokens)
            if timer is not None:
                self._note_launch(timer, marks, previous, time.monotonic() - began)
            argmax, drawn, mapped = self.runner.last_argmax, self.runner.last_drawn, self.runner.last_mapped
            self._frees_at_launch = (self.pool.frees, self.table.frees)
            self.stats.steps += 1
            self.stats.computed_tokens += step.num_tokens
            for req, q_len in zip(step.requests, step.q_lens):
                req.num_computed += q_len
        if previous is not None:
            self._read_back(previous)
            if timer is not None and previous.marks is not None:
                timer.observe(previous.marks)
        # This step has the device from about now (the one before it just ended).
        self._running_since = time.monotonic()
        self._running_key = step.num_tokens if logits is not None else None
        # Side prefills were launched beside ``previous`` (after its launch, before this call): they
        # end about when it does, so wait for them rather than a whole step more.
        self._collect_aside(block=True)
        if logits is not None:
            sampling_reqs = [r for r, s in zip(step.requests, step.samples) if s]
            if sampling_reqs:
                self.grammars.apply_masks(logits, sampling_reqs)
                result = self._sample(logits, argmax, drawn, sampling_reqs, mapped)
                if marks is not None:
                    timer.finish(marks, self.device)
                live, positions, rows = [], [], []
                for i, req in enumerate(sampling_reqs):
                    if req.finished or req.row < 0:  # ended when its previous token was read back
                        self.stats.dropped_tokens += 1
                        continue
                    out = req.sampling.output_token_ids
                    live.append(req)
                    rows.append(i)
                    positions.append(len(out))
                    out.append(PENDING)
                    req.pending_index = i
                    req.last_token_pending = len(out) >= req.sampling.params.max_tokens
                if live:
                    self._in_flight = _InFlight(live, positions, rows, result, [r.sampling for r in sampling_reqs],
                                                marks)
        return self._detokenize_deferred()

    def launch_deadline(self) -> float | None:
        """When the next step is best launched (``time.monotonic()``), or None for at once: just
        before the pipelined step in flight ends, so requests arriving meanwhile join the next step
        rather than the one after it (see :mod:`pd_cluster.engine.launch_timing`). The caller may
        add requests until then."""
        if self._launch_timer is None or self._in_flight is None or self._running_key is None:
            return None
        deadline = self._launch_timer.launch_at(self._running_since, self._running_key)
        # The queues are scanned only where there is a wait to give (not for short steps).
        self._deadline = deadline if deadline is not None and self._can_pipeline() else None
        return self._deadline

    def _note_launch(self, timer: LaunchTimer, marks: StepMarks | None, previous: _InFlight | None,
                     seconds: float) -> None:
        """After a pipelined launch: its host time, and whether the step before still ran (this
        step's span, if timed, then times the device alone). If it did not though the launch
        waited for a deadline, the estimate that set it is dropped."""
        timer.note_launch(seconds)
        ready = previous.result.ready if previous is not None else None
        device_bound = ready is not None and not ready.query()
        if ready is not None:
            stats = self.stats
            stats.pipelined_launches += 1
            stats.launches_after_idle += not device_bound
            n = stats.pipelined_launches
            if n >= 1024 and n & (n - 1) == 0:  # 1024, 2048, ...: a trace of how host-bound steps are
                logger.info("%d of %d pipelined launches found the device idle (the step before had ended)",
                            stats.launches_after_idle, n)
        if marks is not None:
            marks.device_bound = device_bound
        if self._deadline is not None and not device_bound and self._running_key is not None:
            timer.forget(self._running_key)
        self._deadline = None

    def _sample(self, logits: torch.Tensor, argmax: torch.Tensor | None, drawn: GraphDrawn | None,
                reqs: list[Request], mapped: MappedIds | None = None) -> DeviceSample:
        """Launch the sampling of ``reqs``' rows of ``logits``; ``argmax`` and ``drawn``: the rows'
        argmax taken in the step's graph and the ids it drew (a graph draws no row with a grammar),
        unused where a grammar mask changed the logits after them; ``mapped``: that argmax in pinned
        host memory."""
        if any(r.grammar is not None for r in reqs):
            argmax = drawn = mapped = None
        return sample_on_device(logits, [r.sampling for r in reqs], self.penalties, argmax, drawn, mapped)

    def _read_back_in_flight(self) -> None:
        """Read back and accept the pipelined step in flight, if any (before a step that cannot
        pipeline)."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._read_back(previous)

    def _read_back(self, launched: _InFlight) -> None:
        tokens = fetch(launched.result, launched.states)
        now = time.monotonic()
        for req, position, row in zip(launched.requests, launched.positions, launched.rows):
            tok = tokens[row]
            out = req.sampling.output_token_ids
            if req.finished or position >= len(out) or out[position] != PENDING:
                self.stats.dropped_tokens += 1  # drawn after a stop string had ended its request
                continue
            out[position] = tok.token_id
            if req.pending_index is not None and position == len(out) - 1:
                req.pending_index = None
            self._accept_id(req, tok, now, appended=True, count=position + 1)

    def _drop_pending(self, req: Request) -> None:
        """Forget the tokens still on the device for an ending request, and free the KV slots of
        the ones a later step already fed back (never cached: their tokens are gone)."""
        out = req.sampling.output_token_ids
        while out and out[-1] == PENDING:
            out.pop()
        req.pending_index = None
        n = req.num_tokens
        if req.row >= 0 and req.num_computed > n:
            self.pool.free(self.table.read(req.row, req.num_computed)[n:])
            req.num_computed = n

    def _accept_id(self, req: Request, tok: SampledToken, now: float, appended: bool = False,
                   count: int | None = None) -> None:
        """Take a token into the request by id (the next step can use it); its text comes later.
        ``appended``: the token already holds its place in the output (a pipelined step's);
        ``count``: the output's length up to it (default: the whole output)."""
        first = (count or len(req.output_token_ids) + (0 if appended else 1)) == 1
        if first and req.num_cached_tokens:
            self.stats.cached_prompt_tokens += req.num_cached_tokens
        if not appended:
            req.sampling.output_token_ids.append(tok.token_id)
        if tok.logprob is not None:
            req.logprobs.append(tok.logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        self.stats.generation_tokens += 1
        self._deferred.append((req, tok, first))
        grammar_done = req.advance_grammar()
        count = count if count is not None else len(req.output_token_ids)
        if req.prefill_only or grammar_done or req.output.ends_with_token(tok.token_id, count):
            self._drop_pending(req)
            self.scheduler.remove(req)  # never scheduled again; finished once its text is out

    def _detokenize_deferred(self) -> list[TokenUpdate]:
        items, self._deferred = self._deferred, []
        updates: list[TokenUpdate] = []
        for req, tok, first in items:
            if req.finished:  # aborted meanwhile
                continue
            update = req.output.append(tok.token_id, grammar_done=req.grammar is not None and req.grammar.terminated)
            if update.finish_reason is not None:
                self._finish(req, update.finish_reason)
            elif req.prefill_only:
                self._finish(req, None)
            updates.append(TokenUpdate(
                request_id=req.request_id, token_id=tok.token_id, text_delta=update.text_delta,
                logprob=tok.logprob, finish_reason=update.finish_reason, first_token=first,
            ))
        return updates

    def _accept(self, req: Request, token_id: int, logprob, now: float) -> TokenUpdate:
        first = not req.output_token_ids
        if first and req.num_cached_tokens:
            self.stats.cached_prompt_tokens += req.num_cached_tokens
        req.sampling.output_token_ids.append(token_id)
        if logprob is not None:
            req.logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        update = req.output.append(token_id, grammar_done=req.advance_grammar())
        self.stats.generation_tokens += 1
        if update.finish_reason is not None:
            self._finish(req, update.finish_reason)
        elif req.prefill_only:
            self._finish(req, None)
        return TokenUpdate(
            request_id=req.request_id,
            token_id=token_id,
            text_delta=update.text_delta,
            logprob=logprob,
            finish_reason=update.finish_reason,
            first_token=first,
        )

    def _finish(self, req: Request, reason: str | None) -> None:
        """Take a request out of the batch; ``reason`` None: its prefill-only part is done."""
        req.finish_reason = reason
        self._drop_pending(req)
        self.scheduler.remove(req)
        self.penalties.release(req.sampling)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self.stats.finished_requests += 1
        if reason is not None and not req.sampling.params.ignore_eos:
            self.predictor.observe(len(req.output_token_ids))
        self.stats.preemptions = self.scheduler.num_preemptions

    def held_slots(self, req: Request) -> torch.Tensor:
        """KV slots of a finished ``hold_kv`` request's computed tokens (CPU int64)."""
        return self.table.read(req.row, req.num_computed)

    # ---- warm-up ---------------------------------------------------------------------------

    def warm_up(self, prompt_tokens: int = 16, decode_steps: int = 1) -> float:
        """Run two tiny requests through the real path before the node serves, so that kernels
        compile (Triton JIT) and allocations settle before the first real request: a greedy one
        and one sampled with every knob (temperature, top-k/p, min-p, penalties, logit bias,
        logprobs), so the first client to sample does not wait a second for the sampling and
        penalty kernels to compile. Each has a prefill of ``prompt_tokens`` tokens and
        ``decode_steps`` decode steps (0 for a prefill node); then one block of KV is gathered and
        scattered back as a handover does. Returns its seconds.

        Leaves the engine as it found it: every KV slot it took is free again, the prefix cache
        is untouched (nothing inserted, no KV events), and the stats are unchanged. The engine
        must be idle (no requests)."""
        import kernels

        if self.requests or self.scheduler.has_work():
            raise RuntimeError("warm_up needs an idle engine")
        budget = min(self.max_model_len, self.pool.num_free // 2) - decode_steps - 1
        if budget < 1:
            logger.info("no warm-up: the KV pool or context is too small")
            return 0.0
        started = time.monotonic()
        n = min(prompt_tokens, budget)
        vocab = self.model_config.vocab_size
        token_ids = [(7 * i + 3) % vocab for i in range(n)]
        greedy = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01, repetition_penalty=1.1,
                                 frequency_penalty=0.1, presence_penalty=0.1, logit_bias={1 % vocab: 1.0},
                                 logprobs=1, seed=0, max_tokens=decode_steps + 1, ignore_eos=True)
        warm_ids = ("engine-warm-up", "engine-warm-up-sampled")
        stats, preemptions, cache_enabled = self.stats, self.scheduler.num_preemptions, self.cache.enabled
        self.stats = EngineStats()
        self.cache.enabled = False  # the request's KV goes back to the pool, not into the cache
        try:
            self.add_request(warm_ids[0], token_ids, greedy)
            self.add_request(warm_ids[1], token_ids, sampled)
            for _ in range(n + decode_steps + 3):  # each step makes progress: bounded (+2: overlap's last)
                if not self.has_unfinished():
                    break
                self.step()
            slots = self.pool.alloc(min(self.kv_spec.block_size, self.pool.num_free))
            if slots is not None and slots.numel():
                try:
                    device_slots = slots.to(self.device)
                    buffer = kernels.gather_kv(self.pool.k_cache, self.pool.v_cache, device_slots)
                    kernels.scatter_kv(buffer, self.pool.k_cache, self.pool.v_cache, device_slots)
                    kernels.copy_kv_slots(self.pool.k_cache, self.pool.v_cache, device_slots,
                                          self.pool.k_cache, self.pool.v_cache, device_slots)
                finally:
                    self.pool.free(slots)
        finally:
            for request_id in warm_ids:
                if request_id in self.requests:
                    self.abort(request_id)
            self.cache.enabled = cache_enabled
            self.stats = stats
            self.scheduler.num_preemptions = preemptions
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.monotonic() - started
        logger.info("engine warmed up in %.2fs (prefill of %d tokens, %d decode steps)", seconds, n, decode_steps)
        return seconds
