"""The engine's flags are EngineConfig's marked fields: every command that builds an engine, and every
launcher that hands them to its nodes, takes them from there with the field's name, type, default and help."""

from __future__ import annotations

import argparse

import pytest

from pd_cluster.cli import LOCAL_ENGINE_FLAGS, build_parser, engine_config_from_args
from pd_cluster.config import EngineConfig
from pd_cluster.engine_flags import ENGINE_FLAGS, PASSED_ON, engine_argv, engine_flag, given_values
from pd_cluster.flag import Flag
from pd_cluster.local_cluster import LocalCluster, LocalOptions
from pd_cluster.ray_launcher.spec import ClusterSpec
from tests.engine_flags import sample_value

ENGINE_COMMANDS = (["generate", "hi"], ["prefill", "--master", "http://m"], ["decode", "--master", "http://m"],
                   ["mixed", "--master", "http://m"])


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


def test_every_marked_field_is_a_flag_with_its_description_as_help():
    marked = [name for name, info in EngineConfig.model_fields.items()
              if any(isinstance(m, Flag) for m in info.metadata)]
    assert [f.field for f in ENGINE_FLAGS] == marked and len(marked) >= 16
    parser = _subparser(build_parser(), "decode")
    actions = _actions(parser)
    for flag in ENGINE_FLAGS:
        action = actions[flag.field]
        assert action.help == EngineConfig.model_fields[flag.field].description
        assert flag.option in action.option_strings and action.default is None


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: c[0])
def test_an_engine_command_left_alone_builds_the_engine_config_defaults(command):
    config = engine_config_from_args(build_parser().parse_args(command), command[0])
    budget = 512 if command[0] == "decode" else EngineConfig().max_num_batched_tokens
    rows = "auto" if command[0] in ("decode", "mixed") else EngineConfig().max_running_requests
    assert config == EngineConfig(max_num_batched_tokens=budget, max_running_requests=rows)


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: c[0])
def test_every_flag_written_for_a_node_reads_back_as_its_value(command):
    given = {flag.field: sample_value(flag) for flag in ENGINE_FLAGS}
    argv = engine_argv(given, ENGINE_FLAGS)
    config = engine_config_from_args(build_parser().parse_args([*command, *argv]), command[0])
    assert {field: getattr(config, field) for field in given} == given


def test_flags_keep_their_names():
    names = {flag.option for flag in ENGINE_FLAGS}
    assert {"--model", "--device", "--dtype", "--max-total-tokens", "--block-size", "--max-running-requests",
            "--max-num-batched-tokens", "--overlap-schedule", "--mixed-graph-tokens", "--prefill-chunk-tokens",
            "--fused-decode-rows", "--side-prefill-max-tokens", "--draw-graphs", "--late-launch",
            "--gpu-memory-fraction"} <= names
    args = build_parser().parse_args(["decode", "--master", "m", "--no-prefix-cache", "--no-overlap-schedule",
                                      "--mixed-graph-tokens", "none"])
    config = engine_config_from_args(args, "decode")
    assert (config.enable_prefix_cache, config.overlap_schedule, config.mixed_graph_tokens) == (False, False, [])


@pytest.mark.parametrize("words", [["--max-total-tokens", "0"], ["--fused-decode-rows", "9"],
                                   ["--gpu-memory-fraction", "1.5"], ["--mixed-graph-tokens", "1,64"],
                                   ["--mixed-graph-tokens", "a,b"], ["--prefill-chunk-tokens", "0"],
                                   ["--dtype", "fp8"]])
def test_values_the_engine_refuses_are_refused_on_the_command_line(words, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--master", "m", *words])
    assert f"argument {words[0]}" in capsys.readouterr().err


def test_local_takes_the_model_and_every_flag_it_passes_on():
    actions = _actions(_subparser(build_parser(), "local"))
    assert [f.field for f in LOCAL_ENGINE_FLAGS] == ["model", *(f.field for f in PASSED_ON)]
    for flag in LOCAL_ENGINE_FLAGS:
        assert flag.option in actions[flag.field].option_strings
    assert actions["device"].help.endswith("(N: the one GPU every node shares)")  # its own: placement
    assert "gpu_memory_fraction" not in actions  # from the placement


def test_local_hands_every_engine_flag_given_to_each_node():
    given = {flag.field: sample_value(flag) for flag in PASSED_ON}
    args = build_parser().parse_args(["local", "--device", "cpu", "--model", "m", *engine_argv(given)])
    assert given_values(args, LOCAL_ENGINE_FLAGS) == {"model": "m", **given}
    cluster = LocalCluster(LocalOptions(device="cpu", **given_values(args, LOCAL_ENGINE_FLAGS)))
    cluster.plan()
    for spec in cluster.process_specs("token", "admin"):
        if spec.name == "master":
            continue
        argv = list(spec.argv)
        node = build_parser().parse_args(argv[argv.index(spec.role):])
        config = engine_config_from_args(node, spec.role)
        assert {field: getattr(config, field) for field in given} == given and config.model == "m"


def test_ray_start_keeps_every_engine_flag_given_in_its_spec_for_each_node():
    from pd_cluster.ray_launcher.cli import build_parser as ray_parser

    given = {flag.field: sample_value(flag) for flag in PASSED_ON}
    args = ray_parser().parse_args(["ray", "start", "--gpus-per-node", "0", *engine_argv(given)])
    assert given_values(args, PASSED_ON) == given
    spec = ClusterSpec.model_validate_json(ClusterSpec(**given, gpus_per_node=0).model_dump_json())
    assert spec.engine_values() == given
    argv = spec.node_argv("decode", "decode-0", "http://m:8000", "10.0.0.7")
    config = engine_config_from_args(build_parser().parse_args(argv[argv.index("decode"):]), "decode")
    assert {field: getattr(config, field) for field in given} == given


def test_launchers_pass_on_nothing_not_given():
    assert LocalOptions().engine_argv() == [] and ClusterSpec().engine_argv() == []
    spec = ClusterSpec()
    argv = spec.node_argv("prefill", "prefill-0", "http://m:8000", "10.0.0.7")
    assert not {flag.option for flag in PASSED_ON} & set(argv)


def test_launchers_refuse_what_the_engine_would():
    with pytest.raises(ValueError, match="mixed_graph_tokens"):
        LocalOptions(mixed_graph_tokens=[1, 64])
    with pytest.raises(ValueError, match="max_total_tokens"):
        ClusterSpec(max_total_tokens=0)


def test_only_the_model_device_gpu_share_and_tp_are_set_per_node():
    assert {f.field for f in ENGINE_FLAGS if not f.passed_on} == {"model", "device", "gpu_memory_fraction", "tp"}
    with pytest.raises(KeyError):
        engine_flag("seed")  # a config field that is no flag


def test_the_defaults_a_help_text_names_are_the_ones_that_apply():
    from pd_cluster.cli import DECODE_STEP_TOKENS
    from pd_cluster.engine.engine_setup import CPU_DEFAULT_KV_TOKENS

    assert f"or {CPU_DEFAULT_KV_TOKENS} on CPU" in engine_flag("max_total_tokens").help
    budget = engine_flag("max_num_batched_tokens").help
    assert f"default {EngineConfig().max_num_batched_tokens}, on a decode node {DECODE_STEP_TOKENS}:" in budget
    assert f"(default {EngineConfig().side_prefill_max_tokens}: off)" in engine_flag("side_prefill_max_tokens").help
