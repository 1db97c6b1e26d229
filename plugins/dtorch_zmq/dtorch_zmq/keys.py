"""The shared key: ``dtorch keygen FILE`` writes it; controller, agents and workers read it.

A key file holds 32 random bytes as hex on one line, readable by its owner only (0600). The key
never travels: every frame carries an HMAC made with it (``frames.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from .errors import KeyFileError

KEY_BYTES = 32


def write_key(path: str, force: bool = False) -> None:
    """Write a new random key to ``path`` (mode 0600); an existing file is kept unless ``force``."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} exists; pass --force to replace it (every controller, agent and "
                           "worker using the old key must then get the new one)") from None
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
    finally:
        os.close(fd)


def read_key(path: str | None) -> bytes:
    """The key in ``path``; KeyFileError when it is missing, malformed or readable by others."""
    if not path:
        raise KeyFileError("no key file: pass key_file= (or DTORCH_KEY_FILE / --key-file); "
                           "make one with `dtorch keygen FILE`")
    try:
        info = os.stat(path)
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the key file {path}: {exc}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"the key file {path} is readable by others (mode {stat.S_IMODE(info.st_mode):o}); "
                           f"run `chmod 600 {path}`")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"the key file {path} does not hold a dtorch key ({KEY_BYTES} bytes as hex); "
                           "make one with `dtorch keygen FILE`")
    return key


def frame_key(key: bytes) -> bytes:
    """The key the ZMQ frames are signed with: derived, so that no MAC made for the agent's
    tokens (agent_wire.py derives its own) is ever valid as a frame's, or the other way round."""
    return hmac.new(key, b"dtorch zmq frames v1", hashlib.sha256).digest()
