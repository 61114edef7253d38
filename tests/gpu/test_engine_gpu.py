"""The engine on a GPU against its CPU path, on the default model's shape with random weights.

Greedy decoding in float32 on the GPU, with and without CUDA graphs, must give exactly the CPU
path's tokens; bfloat16 can drift from them and is reported as a match rate. The prefill ->
decode handover with layer-wise KV sending must give the single engine's tokens. The random
model is written to a temporary directory: nothing is downloaded.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py -s
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from pd_cluster.config import EngineConfig
from kernels import _triton as kernels_triton
from pd_cluster.engine.cuda_graphs import GraphShape
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = Path(__file__).resolve().parents[2] / "pd_cluster" / "bench" / "configs" / "smollm2-135m.json"
PROMPT_LENS = [5, 17, 64, 129, 250, 333]
MAX_TOKENS = [6, 9, 12, 16, 20, 24]  # finishing one by one: the batch walks through padded sizes


class BlankTokenizer:
    """Random weights have no vocabulary: every token decodes to ""."""

    eos_token_id = None
    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_: Any) -> str:
        return ""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in json.loads(SHAPE.read_text()).items() if not k.startswith("_")})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Larger output weights than a fresh init: clear top-1 margins, so float32 rounding never flips them.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("random-smollm2-shape")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def engine(model_dir: Path, device: str, dtype: str, **options: Any) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_total_tokens=8192,
                          max_running_requests=8, max_model_len=2048, **options)
    return LLMEngine(config, tokenizer=BlankTokenizer())


def generate(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [
        eng.add_request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        for p, m in zip(prompts, MAX_TOKENS)
    ]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


@pytest.fixture(scope="module")
def cpu_tokens(model_dir, prompts) -> list[list[int]]:
    return generate(engine(model_dir, "cpu", "float32"), prompts)


def count_replays(eng: LLMEngine) -> list[tuple[GraphShape, int]]:
    """Record every graph replay: its shape and the step's decode rows."""
    graphs = eng.runner.graphs
    assert graphs is not None
    shapes: list[tuple[GraphShape, int]] = []
    replay = graphs.replay

    def counted(step, layout, shape, *args):
        assert layout.num_decode <= shape.decode and layout.prefill_tokens <= shape.tokens
        shapes.append((shape, layout.num_decode))
        return replay(step, layout, shape, *args)

    graphs.replay = counted  # type: ignore[method-assign]
    return shapes


def test_float32_greedy_on_gpu_equals_the_cpu_path_without_graphs(model_dir, prompts, cpu_tokens):
    eng = engine(model_dir, "cuda", "float32", cuda_graphs=False)
    assert eng.runner.graphs is None
    assert generate(eng, prompts) == cpu_tokens


def test_float32_greedy_with_cuda_graphs_equals_the_cpu_path(model_dir, prompts, cpu_tokens):
    eng = engine(model_dir, "cuda", "float32")
    assert eng.runner.graphs is not None and eng.runner.graphs.batch_sizes == [1, 2, 4, 8]
    shapes = count_replays(eng)
    ring = eng.runner.graphs.mapped_ids
    assert ring is not None and ring.buffer.is_pinned()
    held = []
    hold = ring.hold

    def counted_hold(row, n):
        held.append(row)
        return hold(row, n)

    ring.hold = counted_hold  # type: ignore[method-assign]
    assert eng.scheduler.prefill_chunk_tokens == 512  # the largest mixed graph's prefill tokens
    assert generate(eng, prompts) == cpu_tokens
    # Steps launched behind the one before are counted, and those that found it ended among them.
    stats = eng.stats
    assert 0 < stats.pipelined_launches < stats.steps and 0 <= stats.launches_after_idle <= stats.pipelined_launches
    # Each decode step's ids were read from the pinned row its graph wrote them to (the tokens
    # above came from there), never the spare, and every row was given back once read.
    assert len(held) == sum(1 for shape, _ in shapes if not shape.tokens) and ring.spare not in held
    assert ring.free_rows == ring.DEPTH
    # Every step after the first replayed a graph, padded where the batch fell between captured
    # sizes. The first step took 512 prompt tokens: five prompts and the sixth's first 47 tokens,
    # more prompts than a mixed graph holds (it ran eagerly); the next one the sixth's other 286
    # tokens beside the five rows then decoding.
    assert [shape for shape, _ in shapes if shape.tokens] == [GraphShape(8, 320)]
    rows = [n for _, n in shapes]
    assert sum(rows) == sum(m - 1 for m in MAX_TOKENS)
    assert {3, 5, 6} & set(rows)
    # The padding rows' slot is reserved out of the capacity: everything else is free again.
    eng.cache.flush()
    assert eng.pool.num_free == eng.pool.capacity  # (the pad slot is out of the capacity)


def sampled_params(index: int, max_tokens: int) -> SamplingParams:
    """Seeded draws with each cut, and one greedy row beside them."""
    if index == 1:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95 if index % 2 else 1.0, top_k=50 if index == 2 else 0,
                          min_p=0.02 if index == 3 else 0.0, seed=7 + index, max_tokens=max_tokens, ignore_eos=True)


def generate_sampled(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [eng.add_request(uuid.uuid4().hex, p, sampled_params(i, m))
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


def test_float32_seeded_draws_replayed_in_graphs_equal_the_cpu_path(model_dir, prompts):
    """Sampled decode batches replay the graph that draws after their forward, its ids stored
    into a pinned host row; the tokens are the CPU path's (same seeds, same uniforms), and every
    host row is given back."""
    expected = generate_sampled(engine(model_dir, "cpu", "float32"), prompts)
    eng = engine(model_dir, "cuda", "float32", draw_graphs=True)
    graphs = eng.runner.graphs
    assert graphs is not None
    drawn: list[GraphShape] = []
    run_drawn = graphs.run_drawn

    def counted(shape: GraphShape) -> tuple[torch.Tensor, torch.Tensor]:
        drawn.append(shape)
        return run_drawn(shape)

    graphs.run_drawn = counted  # type: ignore[method-assign]
    assert generate_sampled(eng, prompts) == expected
    assert len(drawn) >= min(MAX_TOKENS) - 1
    ring = graphs.mapped_ids
    assert ring is not None and ring.free_rows == ring.DEPTH


def test_float32_greedy_with_prefill_chunks_in_graphs_equals_the_cpu_path(model_dir, prompts, cpu_tokens):
    """Prompts arriving one by one while others decode: each prefill rides in a mixed graph (the
    first one with no decode rows); the tokens still equal the CPU path's."""
    eng = engine(model_dir, "cuda", "float32")
    shapes = count_replays(eng)
    reqs = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS):
        reqs.append(eng.add_request(uuid.uuid4().hex, prompt,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        eng.step()
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert [list(r.output_token_ids) for r in reqs] == cpu_tokens
    mixed = [shape for shape, _ in shapes if shape.tokens]
    assert len(mixed) == len(prompts)
    # The first prompt (5 tokens) with nothing decoding; the others beside 1 to 5 decode rows (padded
    # to 8, the least mixed decode size); the 333-token prompt pads to 384 tokens.
    assert mixed[0] == GraphShape(0, 32) and all(s.decode == 8 for s in mixed[1:])
    assert [s.tokens for s in mixed] == [32, 32, 64, 192, 256, 384]


def test_float32_long_prompt_prefilled_in_graph_sized_chunks_equals_the_cpu_path(model_dir):
    """A prompt longer than the largest mixed graph is prefilled in chunks of that size, each a
    graph replay (an eager step of a small model is bound by its launches)."""
    prompt = torch.randint(3, 49152, (1100,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = generate(engine(model_dir, "cpu", "float32"), [prompt])
    eng = engine(model_dir, "cuda", "float32")
    shapes = count_replays(eng)
    assert generate(eng, [prompt]) == expected
    prefill = [GraphShape(0, 512), GraphShape(0, 512), GraphShape(0, 128)]  # 76 tokens pad to 128
    assert [shape for shape, _ in shapes if shape.tokens] == prefill
    assert len(shapes) == 3 + MAX_TOKENS[0] - 1  # then every decode step


def test_rows_read_from_the_host_mirror_equal_the_device_table_through_graphs(model_dir, prompts, cpu_tokens):
    """Ended requests' slots come from the host's mirror of the request table (no wait for the
    step in flight): every row read equals the device table's, through decode and mixed graphs,
    and a second round served from the slots cached that way gives the same tokens."""
    eng = engine(model_dir, "cuda", "float32")
    assert eng.table._host is not None
    shapes = count_replays(eng)
    reads = []
    real_read = eng.table.read

    def checked_read(row: int, length: int) -> torch.Tensor:
        got = real_read(row, length)
        reads.append(torch.equal(got, eng.table.table[row, :length].cpu()))
        return got

    eng.table.read = checked_read
    for _ in range(2):
        reqs = []
        for prompt, max_tokens in zip(prompts, MAX_TOKENS):
            reqs.append(eng.add_request(uuid.uuid4().hex, prompt,
                                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
            eng.step()
        while eng.has_unfinished():
            eng.step()
        assert [list(r.output_token_ids) for r in reqs] == cpu_tokens
    assert reads and all(reads)
    assert any(shape.tokens for shape, _ in shapes) and any(not shape.tokens for shape, _ in shapes)


def test_float32_greedy_prefilled_beside_the_step_in_flight_equals_the_cpu_path(model_dir, prompts, cpu_tokens):
    """Requests a node prefills itself, arriving while pipelined steps run, prefill at once on the
    side stream beside the step in flight and then join the batch: the tokens still equal the
    CPU path's (a KV slot or request row shared with the step in flight would change them), one
    aborted mid-prefill gives its KV back, and nothing leaks."""
    eng = engine(model_dir, "cuda", "float32", side_prefill_max_tokens=512)
    assert eng.pipelined and eng.side_prefills.stream is not None
    side_graphs = eng.runner.side_graphs
    assert side_graphs is not None and {s.decode for s in side_graphs.shapes} == {0}
    side_shapes: list[GraphShape] = []
    side_replay = side_graphs.replay

    def replayed(step, layout, shape, *args):
        side_shapes.append(shape)
        return side_replay(step, layout, shape, *args)

    side_graphs.replay = replayed  # type: ignore[method-assign]
    started: list[bool] = []
    prefill_aside = eng._prefill_aside

    def counted(req):
        started.append(prefill_aside(req))
        return started[-1]

    eng._prefill_aside = counted  # type: ignore[method-assign]
    reqs = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reqs.append(eng.add_request(uuid.uuid4().hex, prompt, params, prefill_now=True))
        gone = eng.add_request("aborted-" + uuid.uuid4().hex, prompt, params, prefill_now=True)
        assert eng.abort(gone.request_id)
        eng.step()
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert [list(r.output_token_ids) for r in reqs] == cpu_tokens
    # The first prompt found no step in flight; most later ones (those after no free) went aside.
    assert started[0] is False and sum(started) >= 4, started
    assert len(side_shapes) == sum(started)  # each in a side graph: no prompt here is over 512 tokens
    assert eng.scheduler.external_held == 0 and not eng.side_prefills.pending
    eng.cache.flush()
    assert eng.pool.num_free == eng.pool.capacity and eng.table.num_free_rows == 8


def test_float32_greedy_with_late_launches_through_the_engine_thread_equals_the_cpu_path(
        model_dir, prompts, cpu_tokens):
    """Every launch waits for the step in flight to near its end (however short the steps) while
    requests arrive through the engine thread: the tokens still equal the CPU path's, launches did
    wait, and no KV slot or request row is left behind."""
    from pd_cluster.engine.worker import EngineWorker

    eng = engine(model_dir, "cuda", "float32")
    assert eng.pipelined and eng._launch_timer is not None
    eng._launch_timer.min_step_s = 0.0

    async def main() -> list[list[int]]:
        worker = EngineWorker(eng, lambda updates: None)
        worker.start()
        try:
            reqs = []
            for prompt, max_tokens in zip(prompts, MAX_TOKENS):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                reqs.append(await worker.call(eng.add_request, uuid.uuid4().hex, prompt, params))
                for _ in range(3):  # a few steps run before the next request arrives
                    await worker.call(lambda: None)
            deadline = asyncio.get_running_loop().time() + 120
            while await worker.call(eng.has_unfinished):
                assert asyncio.get_running_loop().time() < deadline, "requests did not finish"
            return [list(r.output_token_ids) for r in reqs]
        finally:
            await worker.stop()

    assert asyncio.run(main()) == cpu_tokens
    assert eng.stats.late_launches > 0
    eng.cache.flush()
    assert eng.pool.num_free == eng.pool.capacity and eng.table.num_free_rows == 8


def test_float32_greedy_through_the_fused_projections_equals_the_cpu_path(
        model_dir, prompts, cpu_tokens):
    """Decode steps of up to four rows fold each norm and the SiLU gate into the projection after
    it (the default for this shape), in graphs, their kernels launched as programmatic dependents:
    one stream at a time, then all at once (the batch walks from six rows, unfused, down to one)."""
    eng = engine(model_dir, "cuda", "float32")
    assert eng.model.fused_rows == 4
    got = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS):
        req = eng.add_request(uuid.uuid4().hex, prompt,
                              SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        got.append(list(req.output_token_ids))
    assert got == cpu_tokens
    eng.cache.flush()
    assert generate(eng, prompts) == cpu_tokens


def test_bfloat16_tokens_are_the_same_with_and_without_dependent_launches(model_dir, prompts):
    """Programmatic dependent launch changes when kernels start, never what they read: a kernel
    that read its input before the one writing it had finished would change bfloat16 tokens."""
    try:
        kernels_triton.set_pdl(False)
        plain = generate(engine(model_dir, "cuda", "bfloat16"), prompts)
        single = generate(engine(model_dir, "cuda", "bfloat16"), prompts[:1])
    finally:
        kernels_triton.set_pdl(True)
    assert generate(engine(model_dir, "cuda", "bfloat16"), prompts) == plain
    assert generate(engine(model_dir, "cuda", "bfloat16"), prompts[:1]) == single


def test_bfloat16_with_graphs_matches_eager_and_reports_agreement_with_float32(model_dir, prompts, cpu_tokens):
    with_graphs = generate(engine(model_dir, "cuda", "bfloat16"), prompts)
    eager = generate(engine(model_dir, "cuda", "bfloat16", cuda_graphs=False), prompts)
    same = sum(a == b for x, y in zip(with_graphs, eager) for a, b in zip(x, y))
    total = sum(len(x) for x in eager)
    agree = sum(a == b for x, y in zip(with_graphs, cpu_tokens) for a, b in zip(x, y))
    prefix = sum(_common_prefix(x, y) for x, y in zip(with_graphs, cpu_tokens))
    print(f"\nbfloat16 vs float32 CPU greedy: {agree}/{total} tokens equal, {prefix}/{total} before the "
          f"first divergence; bf16 graphs vs bf16 eager: {same}/{total}")
    assert all(len(x) == m for x, m in zip(with_graphs, MAX_TOKENS))
    assert same >= 0.9 * total  # only the attention split count differs between the two


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_layerwise_handover_on_gpu_gives_the_engine_tokens(model_dir, prompts, cpu_tokens):
    """P streams KV layer by layer (side stream, events) to D: NCCL across two GPUs, else gloo
    staging on one; D's greedy continuation equals the single engine's."""
    from decode_node.service import DecodeService
    from pd_cluster.protocol import PrefillJob
    from prefill_node.service import PrefillService

    d_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    p_engine = engine(model_dir, "cuda:0", "float32", block_size=16)
    d_engine = engine(model_dir, d_device, "float32", block_size=16)

    async def run() -> list[list[int]]:
        streams: dict[str, list[int]] = {}
        done: dict[str, asyncio.Event] = {}
        loop = asyncio.get_running_loop()

        def on_tokens(updates) -> None:
            for u in updates:
                streams.setdefault(u.request_id, []).append(u.token_id)
                if u.finish_reason is not None:
                    loop.call_soon_threadsafe(done.setdefault(u.request_id, asyncio.Event()).set)

        d = DecodeService(d_engine.config, node_id="d0", cluster_token="t", on_tokens=on_tokens, engine=d_engine)
        p = PrefillService(p_engine.config, node_id="p0", cluster_token="t", engine=p_engine, layerwise_min_tokens=0)
        assert p.layerwise
        await d.start()
        await p.start()
        try:
            out = []
            for prompt, max_tokens in zip(prompts, MAX_TOKENS):
                rid = uuid.uuid4().hex
                done[rid] = asyncio.Event()
                job = PrefillJob(request_id=rid, token_ids=prompt, decode_node_id="d0",
                                 sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                 decode_address=d.data_address, deadline_s=60.0)
                firsts = []

                async def report(first) -> None:
                    firsts.append(first.token_id)

                result = await p.run_job(job, report)
                assert result.committed
                n_blocks = -(-len(prompt) // 16)
                assert result.transfer_bytes == (n_blocks - result.hit_blocks) * p_engine.kv_spec.bytes_per_block
                await asyncio.wait_for(done[rid].wait(), 60.0)
                out.append(firsts + streams[rid])
            return out
        finally:
            await p.stop()
            await d.stop()

    assert asyncio.run(run()) == cpu_tokens
