"""The master's secrets fail closed: a token set to the empty string stops the master at start
(a bearer header with nothing after it would carry it), and no check ever matches an empty one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import SecretStr

from master.app import ConfigError
from master.auth import bearer_matches
from master.server import create_app
from tests import process_server
from tests.cluster_harness import CLUSTER_TOKEN, free_port
from tests.master_fakes import make_settings, tiny_tokenizer, write_model_dir


@pytest.mark.parametrize("variable, value", [("PD_ADMIN_TOKEN", ""), ("PD_STATUS_TOKEN", " \t"),
                                             ("PD_CLUSTER_TOKEN", "")])
def test_an_empty_token_stops_the_master_process_naming_its_variable(tmp_path: Path, variable: str, value: str):
    env = {**os.environ, "PD_CLUSTER_TOKEN": CLUSTER_TOKEN, "PD_ADMIN_TOKEN": "admin-secret", "PYTHONUNBUFFERED": "1"}
    env.pop("PD_STATUS_TOKEN", None)
    env[variable] = value
    log = tmp_path / "master.log"
    master = process_server.start(["master", "--host", "127.0.0.1", "--port", str(free_port()),
                                   "--model", str(write_model_dir(tmp_path))], env, log)
    assert master.wait(60) == 2
    text = log.read_text()
    assert f"{variable} is set but empty" in text
    assert "admin-secret" not in text and CLUSTER_TOKEN not in text  # no value is ever logged


@pytest.mark.parametrize("setting", ["admin_token", "status_token", "cluster_token"])
def test_create_app_refuses_an_empty_or_blank_token(setting: str):
    for value in ("", "   "):
        with pytest.raises(ConfigError, match="is set but empty"):
            create_app(make_settings(**{setting: value}), tokenizer=tiny_tokenizer())


def test_an_unset_admin_or_status_token_still_starts():
    create_app(make_settings(admin_token=None, status_token=None), tokenizer=tiny_tokenizer())


def test_bearer_matches_never_matches_an_empty_secret():
    for header in ("Bearer ", "Bearer", "bearer  ", "Bearer \t"):
        for secret in ("", " ", "\t"):
            assert not bearer_matches(header, SecretStr(secret))
    assert not bearer_matches(None, SecretStr("")) and not bearer_matches("", SecretStr(""))
    assert bearer_matches("Bearer s3cret", SecretStr("s3cret"))
    assert not bearer_matches("Bearer s3cret", None)
