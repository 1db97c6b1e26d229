"""`dtorch keygen`: a fresh 0600 key, never an overwrite without --force."""

from __future__ import annotations

import os
import stat

import pytest
from dtorch_zmq.errors import KeyFileError
from dtorch_zmq.keys import KEY_BYTES, read_key

from dtorch_core.cli import main


def test_keygen_writes_a_private_key(tmp_path, capsys):
    path = tmp_path / "k"
    assert main(["keygen", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = read_key(str(path))
    assert len(key) == KEY_BYTES
    other = tmp_path / "k2"
    assert main(["keygen", str(other)]) == 0
    assert read_key(str(other)) != key  # random, not derived from anything


def test_keygen_refuses_to_overwrite(tmp_path, capsys):
    path = tmp_path / "k"
    assert main(["keygen", str(path)]) == 0
    key = read_key(str(path))
    assert main(["keygen", str(path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert read_key(str(path)) == key
    os.chmod(path, 0o644)
    assert main(["keygen", "--force", str(path)]) == 0
    assert read_key(str(path)) != key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # also when the old file was wider


def test_a_key_readable_by_others_or_malformed_is_refused(tmp_path):
    path = tmp_path / "k"
    main(["keygen", str(path)])
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        read_key(str(path))
    path.write_text("not a key\n")
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match="does not hold a dtorch key"):
        read_key(str(path))
    with pytest.raises(KeyFileError, match="dtorch keygen"):
        read_key(None)
