"""The step loop: schedule -> run the model -> sample -> process the outputs.

One loop serves every mode; overlap scheduling (``EngineConfig.overlap_schedule``, by default on
CUDA devices) is how far ahead it works, so that the device never waits on the host:

- a token's text is made one call after its id is taken (detokenizing and looking for stop
  strings while the device runs the next step);
- where nothing needs a step's end at once (:meth:`LLMEngine._can_pipeline`), the next step is
  launched before this one's ids are read back: one step in flight, its rows taking the ids of
  the step before on the device, optionally launched just before that step ends (late launch,
  :mod:`pd_cluster.engine.launch_timing`), with prefills on a side stream beside it
  (:mod:`pd_cluster.engine.side_prefill`).

What a sampled id does to its request (taken, ended, detokenized) is the postprocessor's
(:mod:`pd_cluster.engine.postprocess`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.default_model import resolve_model_path
from pd_cluster.engine.beam_scorer import BeamScorer
from pd_cluster.engine.beam_search import BeamGroup, BeamResult, BeamSearches
from pd_cluster.engine.batch_rows import resolve_rows, typical_context
from pd_cluster.engine.engine_setup import default_kv_tokens, eos_token_ids, sparse_config, tp_config
from pd_cluster.engine.grammar import Grammars
from pd_cluster.engine.kv_pool import KVPool, torch_dtype
from pd_cluster.engine.launch_timing import LaunchTimer, StepMarks
from pd_cluster.engine.length_predictor import OutputLengthPredictor
from pd_cluster.engine.mapped_ids import MappedIds
from pd_cluster.engine.model_runner import ModelRunner, StepHook
from pd_cluster.engine.output_processor import OutputProcessor
from pd_cluster.engine.outputs import EngineStats, TokenUpdate
from pd_cluster.engine.penalties import PenaltyBook
from pd_cluster.engine.postprocess import InFlight, Postprocessor
from pd_cluster.engine.prompt_logprobs import PromptLogprobsState
from pd_cluster.engine.radix_cache import RadixCache
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.engine.sampler import DeviceSample, GraphDrawn, SamplingState, sample_on_device
from pd_cluster.engine.scheduler import ScheduledStep, Scheduler
from pd_cluster.engine.side_prefill import SidePrefills
from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.engine.tp_kv import KVHeads, rank_kv_spec
from pd_cluster.engine.tp_leader import TPLeader
from pd_cluster.engine.warm_up import WARM_UP_IDS, move_kv_block, warm_up_requests
from pd_cluster.kv_spec import KVSpec
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.llama import LlamaModel
from pd_cluster.model.shard import Shard
from pd_cluster.model.weights import load_weights
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

KVEventSink = Callable[[list[int], list[int]], None]
@dataclass
class _Launched:
    """A step whose forward is queued: its logits, and what its CUDA graph already took of them
    (the rows' argmax, the ids it drew, that argmax in pinned host memory)."""

    step: ScheduledStep
    logits: torch.Tensor
    argmax: torch.Tensor | None
    drawn: GraphDrawn | None
    mapped: MappedIds | None
    #: Events around the step's kernels (late launch's timing), if kept.
    marks: StepMarks | None


class LLMEngine:
    """One model, one KV pool, one prefix cache, and the requests running on them."""

    def __init__(
        self, config: EngineConfig, *, tokenizer=None, load_tokenizer_from_model: bool = True,
        kv_event_sink: KVEventSink | None = None,
    ) -> None:
        self.config = config
        self._asked_rows = config.max_running_requests
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_path(self.model_path)
        device_name = config.resolved_device()
        self.device = torch.device(device_name)
        self.dtype_name = config.resolved_dtype(device_name)
        if tokenizer is None and load_tokenizer_from_model:
            tokenizer = load_tokenizer(self.model_path)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(self.model_config, tokenizer, self.model_path)
        self.grammars = Grammars(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

        if self.model_config.moe is not None:
            config = self.config = sparse_config(config, self.device)
        self.shard = Shard(0, config.tp)
        #: The other ranks of a tensor-parallel node (None at TP 1).
        self.tp: TPLeader | None = None
        if config.tp > 1:
            self.shard.check(self.model_config)
            config = self.config = tp_config(config)
            self.tp = TPLeader(config.tp, str(self.model_path), self.dtype_name, self.device,
                               config.fused_decode_rows, load_format=config.load_format,
                               quantization=config.quantization,
                               all_reduce_mode=config.tp_allreduce,
                               kv_dtype="" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)
        weights = load_weights(self.model_path, self.model_config, torch_dtype(self.dtype_name), self.device,
                               self.shard, config.load_format, quantization=config.quantization)
        self.model = LlamaModel(self.model_config, weights, self.device, fused_rows=config.fused_decode_rows,
                                shard=self.shard, all_reduce=self.tp.group.all_reduce if self.tp else None)
        num_slots = self._make_kv(kv_event_sink)
        if self.tp is not None:
            self.tp.start(int(self.pool.k_cache.shape[1]))
        self._make_loop()
        logger.info(
            "engine ready: model %s on %s (%s, weights %s), %d KV slots (%.1f MiB a rank, of %d), block size %d, prefix cache %s",
            self.model_config.name, self.device, self.dtype_name, config.quantization, num_slots,
            num_slots * self.rank_kv_spec.pool_bytes_per_token / 2**20, config.tp, config.block_size,
            "on" if config.enable_prefix_cache else "off",
        )

    def close(self) -> None:
        """Stop a tensor-parallel node's other ranks (nothing at TP 1)."""
        if self.tp is not None:
            self.tp.close()

    def _make_kv(self, kv_event_sink: KVEventSink | None) -> int:
        """The KV pool, the prefix cache over it and the request-to-slot table; the configured slots."""
        config = self.config
        #: The node's KV, every head: what P and D agree on and hand over, whatever their TP.
        self.kv_spec = KVSpec(
            model=self.model_config.name,
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype_name,
            block_size=config.block_size,
            kv_dtype=config.resolved_kv_dtype(str(self.device)),
        )
        #: What this rank's pool holds: its own heads (every head at TP 1), as each rank's does.
        self.rank_kv_spec = rank_kv_spec(self.model_config, self.shard, self.dtype_name, config.block_size,
                                         self.kv_spec.kv_dtype)
        num_slots = config.max_total_tokens or default_kv_tokens(config, self.device, self.rank_kv_spec)
        # CUDA graphs take one extra slot for their padding rows; the configured count stays usable.
        extra = 1 if (config.cuda_graphs and self.device.type == "cuda") else 0
        self.pool = KVPool(self.rank_kv_spec, num_slots + extra, self.device)
        self.cache = RadixCache(
            self.pool, block_size=config.block_size, enabled=config.enable_prefix_cache, event_sink=kv_event_sink
        )
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.config = config = resolve_rows(config, num_slots, self.max_model_len, self.device.type == "cuda")
        if config.max_running_requests != self._asked_rows:
            logger.info("batch limit auto: %d requests (%d KV slots, typical context %d tokens)",
                        config.max_running_requests, num_slots, typical_context(config, self.max_model_len))
        self.table = ReqSlotTable(config.max_running_requests, self.max_model_len + 1, self.device)
        return num_slots

    def _make_loop(self) -> None:
        """The step loop's parts (scheduler, runner, postprocessor, side prefills) and its state."""
        config = self.config
        self.predictor = OutputLengthPredictor()
        self.scheduler = Scheduler(config, self.pool, self.cache, self.table, self.predictor)
        heads = KVHeads(self.tp.group, self.model_config, self.pool) if self.tp is not None else None
        #: Every head's KV at given slots, read or written for a handover (see pd_cluster.engine.node_kv).
        self.node_kv = NodeKV(self.kv_spec, self.pool, self.tp, heads)
        self.runner = ModelRunner(self.model, self.pool, self.table, self.device, config, tp=self.tp)
        if config.prefill_chunk_tokens is None and self.runner.graphs is not None and config.graph_prefill_tokens():
            # Prefill in chunks that replay the mixed graphs rather than in one eager step.
            self.scheduler.prefill_chunk_tokens = max(config.graph_prefill_tokens())
        self._layer_hooks: StepHook | None = None
        self.penalties = PenaltyBook(self.model_config.vocab_size, self.device)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.postprocessor = Postprocessor(self.scheduler, self.penalties, self.predictor, self.requests, self.stats)
        #: Beam searches (:meth:`add_beam_request`), stepped after the batch's own step.
        # Pipelined as the batch's steps are, unless another copy of the table follows this one's
        # host writes (a tensor-parallel rank's): those learn a fork only once it is read back.
        self.beams = BeamSearches(self.pool, self.table, self.scheduler, self.runner, self._beam_row,
                                  pipelined=self.pipelined and self.table.journal is None)
        #: Ended beam searches not yet taken (:meth:`take_beam_results`).
        self.beam_results: dict[str, BeamResult] = {}
        #: Prefills started on the side stream (:meth:`add_request` with ``prefill_now``).
        self.side_prefills = SidePrefills(config, self.scheduler, self.cache, self.table, self.runner,
                                          self.penalties, self.postprocessor, self.device)
        #: Overlap scheduling: the step launched last, its tokens not yet read back.
        self._in_flight: InFlight | None = None
        #: KV slots and request rows freed up to the last pipelined launch (the step in flight may
        #: still write those freed after it).
        self._frees_at_launch: tuple[int, int] | None = None
        #: Late launch (``config.late_launch``): step times, and the step that has the device now.
        self._launch_timer = LaunchTimer() if self.device.type == "cuda" and config.late_launch else None
        self._running_since = 0.0
        self._running_key: int | None = None
        #: The launch time last handed out (:meth:`launch_deadline`), until the launch it was for.
        self._deadline: float | None = None

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
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=state, output=output,
                      grammar=self.grammars.state(params, prompt_token_ids))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = PromptLogprobsState(req.prompt_token_ids, params.prompt_logprobs)
        return req

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
        if req.prompt_logprobs is not None and not req.prompt_logprobs.complete:
            self.runner.scoring.add(req.prompt_logprobs)
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

    def add_beam_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         prompt_slots: torch.Tensor | None = None) -> BeamGroup:
        """Queue a beam search (``params.use_beam_search``); its result appears in
        :attr:`beam_results` when it ends (:meth:`take_beam_results`). ``prompt_slots``: the
        prompt's KV is already in these slots (handed over; the search holds them from now on,
        and frees them when it cannot start): it starts at once from them."""
        try:
            group = self._beam_group(request_id, prompt_token_ids, params)
        except ValueError:
            if prompt_slots is not None:
                self.pool.free(prompt_slots)
            raise
        self.stats.prompt_tokens += len(prompt_token_ids)
        if prompt_slots is None:
            self.beams.add(group)
        else:
            self.beams.start_from_kv(group, prompt_slots)
        return group

    def _beam_group(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> BeamGroup:
        if not params.use_beam_search:
            raise ValueError("use_beam_search: add_beam_request runs beam searches only")
        self.validate(prompt_token_ids, params)
        if request_id in self.requests or any(g.request_id == request_id for g in self._beam_groups()):
            raise ValueError(f"request_id: {request_id!r} is already running")
        group = BeamGroup(request_id, list(prompt_token_ids), params, self._beam_scorer(params))
        if group.peak_kv > self.pool.capacity:
            raise ValueError(f"max_tokens: {params.beam_width} beams of prompt ({len(prompt_token_ids)}) + max_tokens "
                             f"({params.max_tokens}) exceed the KV pool ({self.pool.capacity} tokens)")
        if params.beam_width > self.config.max_running_requests:
            raise ValueError(f"n: a beam width of {params.beam_width} exceeds the batch's "
                             f"{self.config.max_running_requests} rows")
        return group

    def take_beam_results(self) -> list[BeamResult]:
        """The beam searches ended since the last call."""
        results, self.beam_results = list(self.beam_results.values()), {}
        return results

    def beam_request_ids(self) -> list[str]:
        """Ids of the beam searches queued or running."""
        return [g.request_id for g in self._beam_groups()]

    def _beam_groups(self) -> list[BeamGroup]:
        return self.beams.waiting + self.beams.running

    def _beam_scorer(self, params: SamplingParams) -> BeamScorer:
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return BeamScorer(params.beam_width, params.max_tokens, stop_ids, length_penalty=params.length_penalty,
                          early_stopping=params.early_stopping, top_logprobs=params.logprobs)

    def _beam_row(self, request_id: str, prompt_token_ids: list[int]) -> Request:
        """The request one beam's row runs as: its tokens, never sampled by the batch's sampler
        and never detokenized (its output processor has no prompt to scan: a fork makes one a
        step, on the path between two of the search's forwards)."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        return Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                       sampling=SamplingState.create(params, prompt_token_ids),
                       output=OutputProcessor(self.tokenizer, params, self.eos_token_ids, []),
                       status=RequestStatus.RUNNING)

    def _step_beams(self) -> None:
        for result in self.beams.step():
            self.beam_results[result.request_id] = result
            self.stats.finished_requests += 1

    def _prefill_aside(self, req: Request) -> bool:
        """Prefill a new request now on the side stream, while the pipelined step in flight runs
        (:mod:`pd_cluster.engine.side_prefill`). Safe only with nothing freed since that step's
        launch: the step may still write the KV slots or read the request rows freed after it (a
        request found finished as it ran), and this prefill takes free ones. Returns whether it
        started."""
        if self._in_flight is None or self._frees_at_launch != (self.pool.frees, self.table.frees):
            return False
        miss = self.side_prefills.start(req)
        if miss is None:
            return False
        stats = self.stats
        stats.computed_tokens += miss
        stats.side_prefills += 1
        if stats.side_prefills & (stats.side_prefills - 1) == 0:  # 1, 2, 4, 8, ...: a trace, not a flood
            logger.info("%d of %d requests asked to prefill at once did so on the side stream",
                        stats.side_prefills, stats.prefill_now_requests)
        return True

    def settle_freed_slots(self) -> None:
        """Before free KV slots go to a writer outside this engine's stream (KV arriving from a
        prefill node): those freed since the pipelined step in flight was launched (a request
        found finished as it ran; its slots freed or cached without waiting for the device) may
        still be written by that step, so wait for it. Nothing to wait for otherwise."""
        frees = (self.pool.frees, self.table.frees)
        # The batch's step in flight, and the beam searches' (a search found ended as it ran).
        marks = (self._frees_at_launch, self.beams.frees_at_launch)
        if all(mark is None or mark == frees for mark in marks):
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._frees_at_launch = frees if self._frees_at_launch is not None else None
        if self.beams.frees_at_launch is not None:
            self.beams.frees_at_launch = frees

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return self.beams.abort(request_id)
        req.finish_reason = "abort"
        req.hold_kv = False
        if req.prompt_logprobs is not None:
            self.runner.scoring.discard(req.prompt_logprobs)
        # Prefilled on the side stream, it may still write its KV slots: freed once read back.
        if not self.side_prefills.holds(req):
            self.scheduler.remove(req)
        self.penalties.release(req.sampling)
        req.status = RequestStatus.FINISHED
        return True

    def release(self, req: Request) -> None:
        """Free the KV a finished ``hold_kv`` request kept (into the prefix cache)."""
        self.scheduler.release_kv(req)

    def held_slots(self, req: Request) -> torch.Tensor:
        """KV slots of a finished ``hold_kv`` request's computed tokens (CPU int64)."""
        return self.table.read(req.row, req.num_computed)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or bool(self.postprocessor.deferred) or self._in_flight is not None
                or self.side_prefills.pending or self.beams.has_work())

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
        """One turn of the loop: schedule -> run -> process the outputs; the updates of the tokens
        whose text is out. Launching one step ahead (:meth:`_launches_ahead`), a call:

        1. schedules this step and launches its forward while the previous step may still run;
           rows whose input is the previous step's token take it on the device (the host holds
           :data:`~pd_cluster.engine.request.PENDING` in its place);
        2. reads back the previous step's tokens (the forward keeps the device busy) and takes
           them: EOS, stop ids and the length limit end a request at once, and what this step
           computes for it is dropped;
        3. fills this step's grammar masks (the previous tokens are in their matchers) and
           launches its sampling, leaving the step in flight;
        4. detokenizes the tokens read back; a stop string found there ends its request one step
           late, dropping the token this step draws for it and freeing its KV slot.

        Launching none ahead, the step in flight (if any) is read back first, and this step's
        ids at the end of the call (:meth:`_read_back_now`). With overlap scheduling, updates
        come one call later than without; :meth:`has_unfinished` stays true until they are out."""
        ahead = self._launches_ahead()
        if not ahead:
            self._drain()
        previous, self._in_flight = self._in_flight, None
        launched = self._launch(previous, ahead)
        if previous is not None:
            self._read_back(previous)
        if ahead:
            # This step has the device from about now (the one before it just ended).
            self._running_since = time.monotonic()
            self._running_key = launched.step.num_tokens if launched is not None else None
        # Side prefills were launched beside ``previous`` (after its launch, before this call): they
        # end about when it does, so wait for them rather than a whole step more.
        self.side_prefills.collect()
        sampled = self._launch_sampling(launched)
        if ahead:
            self._in_flight = sampled
            return self.postprocessor.detokenize()
        updates = self._read_back_now(sampled)
        if self.beams.has_work():
            self._step_beams()
        return updates

    def _launches_ahead(self) -> int:
        """Steps left in flight when a call returns: 1 where overlap scheduling may launch the next
        step before this one's ids are read back (:meth:`_can_pipeline`), else 0."""
        return 1 if self.pipelined and self._can_pipeline() else 0

    def _can_pipeline(self) -> bool:
        """Whether the next step may launch before the last one's tokens are read back: not while
        a layer hook streams KV (a prefill node), nor with a prefill-only or held request (whose
        end a prefill node acts on at once), nor while beam searches run (their steps follow the
        batch's, and pipeline on their own: :mod:`pd_cluster.engine.beam_search`)."""
        if self._layer_hooks is not None or self.beams.has_work():
            return False
        sched = self.scheduler
        return not any(r.prefill_only or r.hold_kv for queue in (sched.running, sched.waiting) for r in queue)

    def _drain(self) -> None:
        """Read back and take the pipelined step in flight and the side prefills, if any (before a
        step launched with none ahead)."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self.postprocessor.read_back(previous)
        self.side_prefills.collect()

    def _launch(self, previous: InFlight | None, ahead: int) -> _Launched | None:
        """Schedule a step and queue its forward (None: nothing to run); rows whose input is
        ``previous``'s id take it on the device. A step launched ahead is timed for late launch
        and notes the frees up to its launch."""
        began = time.monotonic()
        step = self.scheduler.schedule()
        if not step.requests:
            return None
        timer = self._launch_timer if ahead else None
        marks = timer.begin(step.num_tokens, self.device) if timer is not None and timer.wants(step.num_tokens) else None
        device_tokens = previous.result.tokens if previous is not None else None
        logits = self.runner.run(step, self._layer_hooks, device_tokens)
        if timer is not None:
            self._note_launch(timer, marks, previous, time.monotonic() - began)
        runner = self.runner
        launched = _Launched(step, logits, runner.last_argmax, runner.last_drawn, runner.last_mapped, marks)
        if ahead:
            self._frees_at_launch = (self.pool.frees, self.table.frees)
        self.stats.steps += 1
        self.stats.computed_tokens += step.num_tokens
        for req, q_len in zip(step.requests, step.q_lens):
            req.num_computed += q_len
        return launched

    def _launch_sampling(self, launched: _Launched | None) -> InFlight | None:
        """Fill the grammar masks of the step's sampling rows (their previous tokens taken by now)
        and queue their sampling; their places held for the ids (None: no id to wait for)."""
        if launched is None:
            return None
        step = launched.step
        reqs = [r for r, s in zip(step.requests, step.samples) if s]
        if not reqs:
            return None
        self.grammars.apply_masks(launched.logits, reqs)
        result = self._sample(launched, reqs)
        if launched.marks is not None and self._launch_timer is not None:
            self._launch_timer.finish(launched.marks, self.device)
        return self.postprocessor.hold_places(reqs, result, launched.marks)

    def _sample(self, launched: _Launched, reqs: list[Request]) -> DeviceSample:
        """Launch the sampling of ``reqs``' rows of the step's logits, with what its graph took of
        them (a graph draws no row with a grammar), unless a grammar mask changed the logits since."""
        argmax, drawn, mapped = launched.argmax, launched.drawn, launched.mapped
        if any(r.grammar is not None for r in reqs):
            argmax = drawn = mapped = None
        return sample_on_device(launched.logits, [r.sampling for r in reqs], self.penalties, argmax, drawn, mapped)

    def _read_back(self, launched: InFlight, text_now: bool = False) -> list[TokenUpdate]:
        """Take a launched step's ids (see :meth:`Postprocessor.read_back`), and its device time
        where it was timed."""
        updates = self.postprocessor.read_back(launched, text_now)
        if self._launch_timer is not None and launched.marks is not None:
            self._launch_timer.observe(launched.marks)
        return updates

    def _read_back_now(self, sampled: InFlight | None) -> list[TokenUpdate]:
        """End a call that leaves no step in flight: its ids read back. With overlap scheduling the
        text of the tokens taken by the last call is made first, while the device runs this step
        (a stop string found there ends its request one step late: the id this step drew for it
        is dropped, its KV slot freed with the request's others); without, there are none, and
        each of this step's tokens has its text made as it is taken."""
        updates = self.postprocessor.detokenize()
        if sampled is not None:
            updates += self._read_back(sampled, text_now=not self.pipelined)
        return updates

    # ---- late launch -----------------------------------------------------------------------

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

    def _note_launch(self, timer: LaunchTimer, marks: StepMarks | None, previous: InFlight | None,
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

    # ---- warm-up ---------------------------------------------------------------------------

    def warm_up(self, prompt_tokens: int = 16, decode_steps: int = 1) -> float:
        """Run two tiny requests through the real path before the node serves, so that kernels
        compile (Triton JIT) and allocations settle before the first real request
        (:func:`pd_cluster.engine.warm_up.warm_up_requests`). Each has a prefill of
        ``prompt_tokens`` tokens and ``decode_steps`` decode steps (0 for a prefill node); then one
        block of KV is gathered and scattered back as a handover does. Returns its seconds.

        Leaves the engine as it found it: every KV slot it took is free again, the prefix cache
        is untouched (nothing inserted, no KV events), and the stats are unchanged. The engine
        must be idle (no requests)."""
        if self.requests or self.scheduler.has_work():
            raise RuntimeError("warm_up needs an idle engine")
        budget = min(self.max_model_len, self.pool.num_free // 2) - decode_steps - 1
        if budget < 1:
            logger.info("no warm-up: the KV pool or context is too small")
            return 0.0
        started = time.monotonic()
        n = min(prompt_tokens, budget)
        stats, preemptions, cache_enabled = self.stats, self.scheduler.num_preemptions, self.cache.enabled
        self._count_into(EngineStats())
        self.cache.enabled = False  # the request's KV goes back to the pool, not into the cache
        try:
            token_ids, params = warm_up_requests(self.model_config.vocab_size, n, decode_steps)
            for request_id, request_params in zip(WARM_UP_IDS, params):
                self.add_request(request_id, token_ids, request_params)
            for _ in range(n + decode_steps + 3):  # each step makes progress: bounded (+2: overlap's last)
                if not self.has_unfinished():
                    break
                self.step()
            move_kv_block(self.pool, self.node_kv, self.kv_spec.block_size, self.device)
        finally:
            for request_id in WARM_UP_IDS:
                if request_id in self.requests:
                    self.abort(request_id)
            self.cache.enabled = cache_enabled
            self._count_into(stats)
            self.scheduler.num_preemptions = preemptions
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.monotonic() - started
        logger.info("engine warmed up in %.2fs (prefill of %d tokens, %d decode steps)", seconds, n, decode_steps)
        return seconds

    def _count_into(self, stats: EngineStats) -> None:
        """Count from now on into ``stats`` (the engine's and its postprocessor's counters are one)."""
        self.stats = self.postprocessor.stats = stats
