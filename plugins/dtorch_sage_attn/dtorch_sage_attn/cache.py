"""The selector's decisions on disk: one JSON file per GPU name and versions of torch, triton and
sageattention, in ``$DTORCH_ATTENTION_CACHE`` (a directory) or ``~/.cache/dtorch/attention/``.

Writers merge their decisions into the file under an exclusive lock (``fcntl.flock`` on a lock
file beside it) and replace it atomically (write a temporary file, then ``os.replace``), so
worker processes deciding at the same time neither corrupt the file nor lose each other's
entries. A file that does not parse is ignored with a warning (and replaced at the next write).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

import attrs
import structlog

from .records import Decision

log = structlog.get_logger(__name__)

FORMAT = 1
LOCK_TIMEOUT_S = 120.0  # a writer that holds the lock longer (a hung timing run) is not waited for


def cache_dir() -> Path:
    override = os.environ.get("DTORCH_ATTENTION_CACHE")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "dtorch" / "attention"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "none"


@attrs.frozen
class CacheIdentity:
    """What a cache file is for: decisions measured on one GPU model with these versions."""

    gpu: str
    versions: tuple  # ((package, version or None), ...)

    def file_name(self) -> str:
        parts = [_slug(self.gpu)] + [f"{name}-{_slug(str(version))}" for name, version in self.versions]
        return "__".join(parts) + ".json"


@attrs.define
class DecisionCache:
    """Read and merge-write the decisions of one :class:`CacheIdentity`."""

    identity: CacheIdentity
    directory: Path = attrs.field(factory=cache_dir)
    _warned: bool = False

    @property
    def path(self) -> Path:
        return self.directory / self.identity.file_name()

    def load(self) -> dict[str, Decision]:
        return self._decisions(read_file(self.path, warn=not self._warned, on_warn=self._note_warned))

    def _note_warned(self) -> None:
        self._warned = True

    @staticmethod
    def _decisions(data: dict | None) -> dict[str, Decision]:
        if not data:
            return {}
        out = {}
        for key, entry in data.get("decisions", {}).items():
            try:
                out[key] = Decision.from_json(entry)
            except (KeyError, TypeError, ValueError):
                continue
        return out

    @contextlib.contextmanager
    def locked(self):
        """Hold the file's lock (other processes' writers and deciders wait), or go on without it
        after :data:`LOCK_TIMEOUT_S`, or without one where the directory cannot be written."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_suffix(".lock"), "a+")  # noqa: SIM115 - closed below
        except OSError as exc:
            log.warning("attention cache not writable; deciding without its lock", path=str(self.path), error=str(exc))
            yield
            return
        with handle:
            deadline = time.monotonic() + LOCK_TIMEOUT_S
            held = False
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("attention cache lock not acquired; deciding without it", path=str(self.path))
                        break
                    time.sleep(0.01)
            try:
                yield
            finally:
                if held:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def store(self, key: str, decision: Decision) -> None:
        """Merge one decision into the file (call inside :meth:`locked`)."""
        data = read_file(self.path, warn=False) or {}
        decisions = data.get("decisions", {}) if data.get("format") == FORMAT else {}
        decisions[key] = decision.to_json()
        payload = {"format": FORMAT, "gpu": self.identity.gpu,
                   "versions": {name: version for name, version in self.identity.versions},
                   "decisions": decisions}
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(payload, out, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def read_file(path: Path, *, warn: bool = True, on_warn=None) -> dict | None:
    """A cache file's contents, or None if it is missing or corrupt (with a warning)."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if warn:
            _warn(f"attention cache {path} is unreadable ({exc}); ignoring it", on_warn)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("decisions", {}), dict):
            raise ValueError("not a decisions object")  # noqa: TRY004 - caught below with the parse errors
    except ValueError as exc:
        if warn:
            _warn(f"attention cache {path} is corrupt ({exc}); ignoring it (it is rewritten at the next decision)",
                  on_warn)
        return None
    return data


def _warn(message: str, on_warn) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning(message)
    if on_warn is not None:
        on_warn()


def list_files(directory: Path | None = None) -> list[tuple[Path, dict | None]]:
    """Every cache file in ``directory`` (default :func:`cache_dir`) with its contents (None if
    corrupt), for ``dtorch info`` and ``dtorch attention``."""
    directory = directory or cache_dir()
    if not directory.is_dir():
        return []
    return [(p, read_file(p, warn=False)) for p in sorted(directory.glob("*.json"))]
