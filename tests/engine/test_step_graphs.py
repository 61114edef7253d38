"""The inputs CUDA step graphs replay on (pd_cluster.engine.cuda_graphs), checked on CPU.

A graph replays a forward over static buffers: decode rows padded to a captured batch size, then
prefill chunks padded to a captured token count. Here the "replay" runs that forward eagerly on
the buffers the step wrote, so the layout (which token goes where, which rows' logits come back,
the request table's new slots, padding that must not disturb real rows) is checked without a
GPU: greedy tokens must equal the engine's own eager steps, and the shapes used are recorded.
"""

from __future__ import annotations

import uuid
from unittest import mock

import pytest
import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine import llm_engine
from pd_cluster.engine.cuda_graphs import GraphShape, StepGraphs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.step_layout import StepLayout
from pd_cluster.sampling_params import SamplingParams
from tests.engine_flags import check_switch_reaches_every_node

PROMPT_LENS = [5, 40, 23, 70, 9]
MAX_TOKENS = [7, 9, 4, 8, 6]


def _engine(model_dir, pipelined: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_total_tokens=4096, max_model_len=256,
                                  max_running_requests=8, overlap_schedule=pipelined))


def _eager_graphs(engine: LLMEngine, shapes: list[GraphShape], draws: list[GraphShape] | None = None,
                  pad_slot: int | None = None, table: ReqSlotTable | None = None) -> StepGraphs:
    """Step graphs whose replay is the captured forward run eagerly on the static buffers; with
    ``draws``, their decode shapes also drawing (replays recorded there), run eagerly the same way.
    ``pad_slot`` and ``table``: another rank's (by default the engine's, its padding slot reserved)."""
    if pad_slot is None:
        pad_slot = int(engine.pool.reserve(1)[0])
    sizes = [1, 2, 4, 8]
    graphs = StepGraphs(engine.model, engine.pool, table or engine.table, sizes, pad_slot,
                        prefill_tokens=[32, 64], max_prefills=2, draws=draws is not None)
    assert (graphs.draw_inputs is not None) == (draws is not None)

    def keep(shape: GraphShape, logits: torch.Tensor, argmax: torch.Tensor | None) -> None:
        if argmax is not None:  # a decode graph takes its rows' argmax too (greedy sampling in the graph)
            graphs._logits[shape] = logits
            graphs._argmax[shape] = argmax

    def run_graph(shape: GraphShape) -> torch.Tensor:
        shapes.append(shape)
        logits, argmax = graphs.forward(shape)
        keep(shape, logits, argmax)
        return logits

    def run_drawn(shape: GraphShape) -> tuple[torch.Tensor, torch.Tensor]:
        assert draws is not None
        shapes.append(shape)
        draws.append(shape)
        logits, tokens = graphs.forward_and_draw(shape)
        keep(shape, logits, tokens)
        return logits, tokens

    graphs.run_graph = run_graph  # type: ignore[method-assign]
    if draws is not None:
        graphs.run_drawn = run_drawn  # type: ignore[method-assign]
        graphs._drawn_graphs = {GraphShape(b): None for b in sizes}  # type: ignore[misc]  # "captured"
    return graphs


def _greedy(index: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _mixed_settings(index: int, max_tokens: int) -> SamplingParams:
    """Seeded draws with every cut, one row greedy, one asking for logprobs."""
    if index == 2:
        return _greedy(index, max_tokens)
    return SamplingParams(temperature=0.9, top_p=0.9 if index % 2 else 1.0, top_k=40 if index == 1 else 0,
                          min_p=0.05 if index == 3 else 0.0, seed=100 + index, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=2 if index == 4 else None)


def _staggered(engine: LLMEngine, prompts: list[list[int]], settings=_greedy) -> list[list[int]]:
    """Prompts arrive one per two steps while the earlier ones decode."""
    reqs = []
    for index, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS)):
        params = settings(index, max_tokens)
        reqs.append(engine.add_request(uuid.uuid4().hex, prompt, params))
        engine.step()
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return [list(r.output_token_ids) for r in reqs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_graph_inputs_give_the_eager_steps_tokens(default_model_dir, prompts, pipelined):
    """Pipelined, each step's inputs take the last step's ids on the device (PENDING on the host).
    Greedy decode steps sample the argmax their graph took."""
    expected = _staggered(_engine(default_model_dir), prompts)
    engine = _engine(default_model_dir, pipelined)
    shapes: list[GraphShape] = []
    engine.runner.graphs = _eager_graphs(engine, shapes)
    graph_argmax, host_rows = [], []
    sample_on_device = llm_engine.sample_on_device

    def spy(logits, states, penalties=None, argmax=None, draw=None, mapped=None):
        graph_argmax.append(argmax is not None)
        if mapped is not None:  # the graph's argmax also stored its ids into a host row
            host_rows.append(mapped.host.tolist())
        return sample_on_device(logits, states, penalties, argmax, draw, mapped)

    with mock.patch.object(llm_engine, "sample_on_device", spy):
        assert _staggered(engine, prompts) == expected
    decode_steps = sum(1 for s in shapes if not s.tokens)
    assert graph_argmax.count(True) == decode_steps
    # Every greedy decode step's ids came back through a host row (the tokens above are read
    # there), and every row was given back once read.
    assert len(host_rows) == decode_steps and all(host_rows)
    ring = engine.runner.graphs.mapped_ids
    assert ring is not None and ring.free_rows == ring.DEPTH
    mixed = [s for s in shapes if s.tokens]
    # The 5-token prompt alone (no decode rows), then prompts beside running streams (padded to 8,
    # the only mixed decode size here); the 70-token prompt fits no graph and ran eagerly.
    assert mixed == [GraphShape(0, 32), GraphShape(8, 64), GraphShape(8, 32), GraphShape(8, 32)]
    assert {s.decode for s in shapes if not s.tokens} >= {1, 2, 4}
    # Every slot is free again once the prefix cache lets go (the padding rows' is out of the capacity).
    engine.cache.flush()
    assert engine.pool.num_free == engine.pool.capacity


def test_with_every_host_row_held_the_ids_come_back_by_the_copy(default_model_dir, prompts):
    """Rows held by results not yet read are never written: a step then writes the spare row, and
    its ids come back by the copy to the host, the same tokens."""
    expected = _staggered(_engine(default_model_dir), prompts)
    engine = _engine(default_model_dir, pipelined=True)
    shapes: list[GraphShape] = []
    engine.runner.graphs = _eager_graphs(engine, shapes)
    ring = engine.runner.graphs.mapped_ids
    assert ring is not None
    held = [ring.take() for _ in range(ring.DEPTH)]
    ring.buffer[: ring.DEPTH] = -7  # what a reader of those rows would find
    mapped_seen = []
    sample_on_device = llm_engine.sample_on_device

    def spy(logits, states, penalties=None, argmax=None, draw=None, mapped=None):
        mapped_seen.append(mapped)
        return sample_on_device(logits, states, penalties, argmax, draw, mapped)

    with mock.patch.object(llm_engine, "sample_on_device", spy):
        assert _staggered(engine, prompts) == expected
    assert any(not s.tokens for s in shapes) and mapped_seen and all(m is None for m in mapped_seen)
    assert (ring.buffer[: ring.DEPTH] == -7).all() and ring.free_rows == 0
    for row in held:
        ring.give_back(row)
    assert ring.free_rows == ring.DEPTH


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_sampled_decode_steps_replay_their_draw_and_draw_the_eager_tokens(default_model_dir, prompts, pipelined):
    """A decode batch with seeded draws (and a greedy row, every cut, a row asking for logprobs)
    replays the graph that draws after its forward, reading the settings from its static buffers:
    the tokens are the eager sampling's, and every host row is given back."""
    expected = _staggered(_engine(default_model_dir), prompts, _mixed_settings)
    engine = _engine(default_model_dir, pipelined)
    shapes: list[GraphShape] = []
    draws: list[GraphShape] = []
    engine.runner.graphs = _eager_graphs(engine, shapes, draws)
    assert _staggered(engine, prompts, _mixed_settings) == expected
    decode_shapes = [s for s in shapes if not s.tokens]
    # Every decode step drew in its graph but those whose rows were all greedy (a lone greedy
    # request's last steps).
    assert draws and set(draws) <= set(decode_shapes) and len(draws) >= len(decode_shapes) - 3
    ring = engine.runner.graphs.mapped_ids
    assert ring is not None and ring.free_rows == ring.DEPTH


def test_layout_puts_one_token_rows_first_and_pads_the_decode_part():
    from pd_cluster.engine.scheduler import ScheduledStep

    class Req:
        def __init__(self, n: int) -> None:
            self.num_computed, self.n = 0, n

        def token_ids(self, a: int, b: int) -> list[int]:
            return list(range(a, b))

    step = ScheduledStep()
    for q_len in (3, 1, 5, 1):
        step.add(Req(q_len), q_len, torch.arange(q_len), sample=True)
    layout = StepLayout.of(step)
    assert layout.decode == [1, 3] and layout.prefill == [0, 2] and layout.prefill_tokens == 8
    assert layout.token_starts(step) == [2, 0, 5, 1]
    assert layout.token_starts(step, decode_rows=8) == [8, 0, 11, 1]


def test_draw_graphs_are_asked_for_on_the_command_line_and_reach_every_node():
    """On by default; ``--no-draw-graphs`` turns the engine's setting off, and ``pd-cluster local``
    hands the flag to each node it starts."""
    check_switch_reaches_every_node("draw-graphs", "draw_graphs")


def test_mapped_id_rows_held_until_read_and_the_spare_when_all_are_held():
    """A host row a step's ids went to is not handed out again while its result is unread; with
    every row held, steps write the spare row (read by no one) and come back by the copy."""
    from pd_cluster.engine.mapped_ids import MappedIdRing

    ring = MappedIdRing(4, torch.device("cpu"))
    held = []
    for i in range(ring.DEPTH):
        row = ring.take()
        ring.buffer[row, :2] = torch.tensor([i, -i])
        held.append(ring.hold(row, 2))
    assert len({m.host.data_ptr() for m in held}) == ring.DEPTH and ring.free_rows == 0
    assert ring.take() == ring.spare and ring.hold(ring.spare, 2) is None
    assert [m.host.tolist() for m in held] == [[i, -i] for i in range(ring.DEPTH)]
    held[3].release()
    held[3].release()  # once only
    assert ring.free_rows == 1
    del held[5]  # an unread result dropped gives its row back too
    assert ring.free_rows == 2
    ring.give_back(ring.spare)  # a no-op
    assert ring.free_rows == 2


def test_a_rank_that_follows_the_plans_replays_on_the_same_inputs(default_model_dir, prompts):
    """A tensor-parallel rank replays each step's graph from rank 0's plan: the packed static
    inputs, the request table's writes since the last step (eager steps and a prefix hit write it
    outside any graph), and, where a pipelined step reads ids left on the device, those ids. A
    follower with a table of its own, fed only that, computes the same logits at every step."""
    expected = _staggered(_engine(default_model_dir), prompts)
    engine = _engine(default_model_dir, pipelined=True)
    shapes: list[GraphShape] = []
    graphs = engine.runner.graphs = _eager_graphs(engine, shapes)
    table = ReqSlotTable(*engine.table.table.shape, engine.device)
    follower = _eager_graphs(engine, [], pad_slot=graphs.pad_slot, table=table)
    engine.table.journal = []
    theirs, ours, plans = [], [], {"pending": 0, "writes": 0}

    def follow(shape: GraphShape, inputs: torch.Tensor, pending: bool) -> None:
        journal = engine.table.take_journal()
        plans["writes"] += journal.shape[1]
        plans["pending"] += pending
        table.apply_journal(journal)
        if pending:  # the model group's broadcast of the last step's ids
            follower.prev_ids.copy_(graphs.prev_ids)
        theirs.append(follower.replay_packed(shape, inputs).clone())

    replay, run_graph = graphs.replay, graphs.run_graph
    graphs.replay = lambda step, layout, shape, tokens=None, before=None: replay(step, layout, shape, tokens, follow)
    graphs.run_graph = lambda shape: ours.append(run_graph(shape).clone()) or ours[-1]
    assert _staggered(engine, prompts) == expected
    assert plans["pending"] and plans["writes"] and len(theirs) == len(ours) == len(shapes)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
