"""The ``dtorch`` command (sub-commands come from the ``dtorch_register_cli_commands`` hook)."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def dtorch_register_cli_commands(registry) -> None:
    pass


def main(argv=None) -> int:
    raise SystemExit("dtorch CLI: not built yet")
