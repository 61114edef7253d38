"""``--max-running-requests auto``: a decode node's batch limit from its KV pool at a typical
context, between a floor and the largest decode graph; the default on decode and mixed nodes."""

from __future__ import annotations

import pytest

from pd_cluster.cli import build_parser, engine_config_from_args
from pd_cluster.config import EngineConfig
from pd_cluster.engine.batch_rows import (
    MAX_ROWS_CPU,
    MAX_ROWS_GPU,
    MIN_ROWS,
    auto_rows,
    resolve_rows,
    typical_context,
)
from pd_cluster.engine.llm_engine import LLMEngine

AUTO = EngineConfig(max_running_requests="auto")
#: KV tokens of an 8B (Llama-3) shape's pool: 128 KiB a token, about 52 GiB on an 80 GB GPU and
#: 100 GiB on an H200.
POOL_80GB = 52 * 2**30 // (128 * 2**10)
POOL_H200 = 100 * 2**30 // (128 * 2**10)


def test_typical_context_is_an_eighth_of_the_context_within_bounds_unless_given():
    assert typical_context(AUTO, 8192) == 1024
    assert typical_context(AUTO, 131072) == 2048  # a long-context model: still a serving prompt's size
    assert typical_context(AUTO, 1024) == 256 and typical_context(AUTO, 128) == 128
    assert typical_context(EngineConfig(typical_context=3000), 8192) == 3000
    assert typical_context(EngineConfig(typical_context=9000), 8192) == 8192


def test_auto_fills_the_pool_at_the_typical_context_up_to_the_largest_graph():
    assert auto_rows(AUTO, POOL_80GB, 8192, on_gpu=True) == POOL_80GB // 1024 == 416
    assert auto_rows(AUTO, POOL_H200, 8192, on_gpu=True) == MAX_ROWS_GPU == 512
    assert auto_rows(EngineConfig(typical_context=4096), POOL_H200, 8192, on_gpu=True) == POOL_H200 // 4096
    assert auto_rows(EngineConfig(cuda_graph_batch_sizes=[1, 8, 256]), POOL_H200, 8192, on_gpu=True) == 256
    assert auto_rows(AUTO, 8_000, 8192, on_gpu=True) == MIN_ROWS  # a small pool: the floor


def test_on_cpu_auto_is_a_small_batch():
    assert auto_rows(AUTO, 16384, 8192, on_gpu=False) == MIN_ROWS
    assert auto_rows(AUTO, 10**7, 8192, on_gpu=False) == MAX_ROWS_CPU


def test_a_number_is_kept_and_auto_becomes_one():
    assert resolve_rows(EngineConfig(max_running_requests=48), 10**6, 8192, True).max_running_requests == 48
    resolved = resolve_rows(AUTO, POOL_80GB, 8192, True)
    assert resolved.max_running_requests == 416 and resolved.graph_batch_sizes()[-1] == 416
    with pytest.raises(ValueError):
        AUTO.graph_batch_sizes()


@pytest.mark.parametrize("role,rows", [("decode", "auto"), ("mixed", "auto"), ("prefill", 64)])
def test_decode_and_mixed_nodes_default_to_auto_and_prefill_keeps_64(role, rows):
    args = build_parser().parse_args([role, "--master", "http://m"])
    assert engine_config_from_args(args, role).max_running_requests == rows
    given = build_parser().parse_args([role, "--master", "http://m", "--max-running-requests", "12"])
    assert engine_config_from_args(given, role).max_running_requests == 12


def test_the_flag_takes_auto_or_a_positive_number(capsys):
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["prefill", "--master", "m", "--max-running-requests", "auto"]),
                                   "prefill").max_running_requests == "auto"
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["decode", "--master", "m", "--max-running-requests", bad])
        assert "argument --max-running-requests" in capsys.readouterr().err


def test_an_engine_resolves_auto_when_its_pool_is_sized(default_model_dir):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu", max_total_tokens=4096,
                                    max_model_len=256, max_running_requests="auto"))
    # 4096 slots at 256 tokens (the floor of the typical context) each: 16 rows, on CPU at most 32.
    assert engine.config.max_running_requests == 16 and engine.table.table.shape[0] == 16
