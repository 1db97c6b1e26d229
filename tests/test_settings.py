"""One validation for every setting of dt.init, argument or environment variable (issue 13)."""

from __future__ import annotations

import warnings

import pytest

import dtorch_core as dt
from dtorch_core.errors import ConfigError

VARS = ("DTORCH_RUNNER", "DTORCH_WORLD_SIZE", "DTORCH_STRICT", "DTORCH_TIMEOUT")


@pytest.fixture
def env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    dt.shutdown()
    yield monkeypatch
    dt.shutdown()


@pytest.mark.parametrize(
    "var, value, match",
    [
        ("DTORCH_WORLD_SIZE", "abc", r"DTORCH_WORLD_SIZE is 'abc'; world_size must be a whole number >= 1"),
        ("DTORCH_WORLD_SIZE", "0", r"DTORCH_WORLD_SIZE is '0'; world_size must be a whole number >= 1"),
        ("DTORCH_WORLD_SIZE", "2.5", r"DTORCH_WORLD_SIZE"),
        ("DTORCH_TIMEOUT", "abc", r"DTORCH_TIMEOUT is 'abc'; timeout must be a number of seconds > 0"),
        ("DTORCH_TIMEOUT", "-1", r"DTORCH_TIMEOUT is '-1'; timeout must be a number of seconds > 0"),
        ("DTORCH_TIMEOUT", "inf", r"DTORCH_TIMEOUT"),
        ("DTORCH_RUNNER", "nope", r"DTORCH_RUNNER is 'nope'; runner must be one of .*thread"),
        ("DTORCH_STRICT", "maybe", r"DTORCH_STRICT is 'maybe'; strict must be one of 1/0"),
    ],
)
def test_bad_environment_variable_names_itself(env, var, value, match):
    env.setenv(var, value)
    with pytest.raises(ConfigError, match=match) as info:
        dt.init()
    assert f"unset {var}" in str(info.value)
    assert not dt.is_initialized()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, r"dt.init\(world_size=...\) is 0; world_size must be a whole number >= 1"),
        ({"world_size": -1}, r"world_size=...\) is -1"),
        ({"world_size": "two"}, r"world_size=...\) is 'two'"),
        ({"world_size": True}, r"world_size=...\) is True"),
        ({"timeout": -1}, r"dt.init\(timeout=...\) is -1; timeout must be a number of seconds > 0"),
        ({"timeout": 0}, r"timeout=...\) is 0"),
        ({"timeout": float("nan")}, r"timeout=...\) is nan"),
        ({"runner": "nope"}, r"dt.init\(runner=...\) is 'nope'; runner must be one of"),
        ({"strict": "maybe"}, r"dt.init\(strict=...\) is 'maybe'"),
    ],
)
def test_bad_argument_names_itself(env, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        dt.init(**kwargs)
    assert not dt.is_initialized()


def test_config_error_is_a_typed_value_error():
    assert issubclass(ConfigError, dt.DTorchError) and issubclass(ConfigError, ValueError)


def test_good_values_from_the_environment(env):
    env.setenv("DTORCH_WORLD_SIZE", " 3 ")
    env.setenv("DTORCH_TIMEOUT", "12.5")
    env.setenv("DTORCH_STRICT", "yes")
    env.setenv("DTORCH_RUNNER", "inline")
    session = dt.init()
    assert (session.world_size, session.timeout, session.strict, session.runner.name) == (3, 12.5, True, "inline")


def test_an_argument_that_overrides_the_environment_warns(env):
    env.setenv("DTORCH_WORLD_SIZE", "2")
    env.setenv("DTORCH_RUNNER", "thread")
    with pytest.warns(UserWarning, match=r"dt.init\(world_size=4\) overrides DTORCH_WORLD_SIZE=2.*argument wins"):
        session = dt.init(world_size=4, runner="inline")
    assert session.world_size == 4 and session.runner.name == "inline"
    dt.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same value: nothing to warn about
        dt.init(world_size=2, runner="thread")
