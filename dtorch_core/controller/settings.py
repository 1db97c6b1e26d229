"""Settings of a session: one validation for ``dt.init`` arguments and ``DTORCH_*`` variables."""

from __future__ import annotations

import math
import os
import warnings

from ..errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _parse(kind: str, text):
    if kind == "int":
        if isinstance(text, bool):
            raise ValueError
        if isinstance(text, float) and not text.is_integer():
            raise ValueError
        return int(str(text).strip()) if isinstance(text, str) else int(text)
    if kind == "seconds":
        if isinstance(text, bool):
            raise ValueError
        value = float(text)
        if not math.isfinite(value) or value <= 0:
            raise ValueError
        return value
    if kind == "flag":
        if isinstance(text, bool):
            return text
        if isinstance(text, str) and text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise ValueError
    raise AssertionError(kind)


_ALLOWED = {"int": "a whole number", "seconds": "a number of seconds > 0",
            "flag": "one of 1/0, true/false, yes/no, on/off"}


def setting(name: str, value, env: str | None, default, kind: str, *, minimum: int | None = None,
            choices=None, overridden_by: str | None = None):
    """The value of setting ``name``: the argument ``value`` when given (not None), else the
    environment variable ``env`` when set, else ``default``. A bad value raises ConfigError
    naming the setting (``name=`` argument or ``env`` variable) and what it accepts; an
    argument that overrides a different value of ``env`` warns (the argument wins).

    ``kind``: "int" (with ``minimum``), "seconds" (finite, > 0), "flag" or "name" (one of
    ``choices``). ``overridden_by`` names what sets ``env`` besides the user (e.g. a CLI flag).
    """
    raw_env = os.environ.get(env) if env else None
    if value is not None:
        where, raw = f"dt.init({name}=...)", value
    elif raw_env is not None and (raw_env.strip() or kind == "name"):
        where, raw = f"the environment variable {env}", raw_env
    else:
        return default
    allowed = _ALLOWED.get(kind, "")
    if kind == "int" and minimum is not None:
        allowed += f" >= {minimum}"
    try:
        if kind == "name":
            if raw not in choices:
                raise ValueError
            parsed = raw
        else:
            parsed = _parse(kind, raw)
        if minimum is not None and parsed < minimum:
            raise ValueError
    except (TypeError, ValueError):
        if kind == "name":
            allowed = "one of " + ", ".join(map(str, choices))
        fix = f"; fix or unset {env}" if value is None else ""
        raise ConfigError(f"{where} is {raw!r}; {name} must be {allowed}{fix}") from None
    if value is not None and raw_env is not None and raw_env.strip():
        try:
            env_value = raw_env if kind == "name" else _parse(kind, raw_env)
        except (TypeError, ValueError):
            env_value = None
        if env_value != parsed:
            by = f" (set by {overridden_by} or the environment)" if overridden_by else ""
            warnings.warn(f"dt.init({name}={value!r}) overrides {env}={raw_env}{by}; the argument wins",
                          UserWarning, stacklevel=3)
    return parsed
