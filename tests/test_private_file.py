"""Files holding a secret (mesh/private_file.py): read only where nobody but their owner
can read them, as ssh reads a private key; the API key file and the cluster secret file
both go through it."""

from __future__ import annotations

import os

import pytest

from skippy.mesh.front.edge import KeyFileError, load_api_keys
from skippy.mesh.private_file import read_private
from skippy.mesh.stage.security import SecretError, load_secret
from skippy.topology.errors import UserError


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o602])
def test_a_file_its_group_or_others_may_open_is_refused_in_one_line(tmp_path, mode):
    path = tmp_path / "keys"
    path.write_text("alpha\n")
    path.chmod(mode)
    for load, error in ((load_api_keys, KeyFileError), (load_secret, SecretError)):
        with pytest.raises(error) as refused:
            load(str(path))
        message = str(refused.value)
        assert "\n" not in message and str(path) in message
        assert f"mode {mode:o}" in message and f"chmod 600 {path}" in message


def test_a_file_only_its_owner_reads_is_read(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alpha\n")
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert load_api_keys(path) == {"alpha"} and load_secret(str(path)) == "alpha"


def test_a_pipe_is_read_whatever_its_mode(tmp_path):
    """`--api-keys-file <(pass show skippy)`: the shell's pipe, which no one else opens."""
    read, write = os.pipe()
    os.write(write, b"from-a-pipe\n")
    os.close(write)
    try:
        assert read_private(f"/dev/fd/{read}", "the API key file", UserError) == "from-a-pipe\n"
    finally:
        os.close(read)
