"""CURVE key files (``tserve._curve``) and the commands that take them, without an engine."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from tserve.__main__ import main
from tserve._curve import KeyFileError, client_keys, require_keys, server_keys, write_keys

FILES = {"server.key", "server.key_secret", "client.key", "client.key_secret"}


def test_keys_writes_two_pairs_flat_with_private_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "keys"
    assert main(["keys", str(directory)]) == 0
    assert {p.name for p in directory.iterdir()} == FILES  # flat: a k8s Secret keeps names only
    assert set(capsys.readouterr().out.split()) == {str(directory / name) for name in FILES}
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
    assert modes == {
        "server.key": 0o644,
        "client.key": 0o644,
        "server.key_secret": 0o600,
        "client.key_secret": 0o600,
    }
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_the_two_sides_read_matching_keys(tmp_path: Path) -> None:
    write_keys(tmp_path)
    server, client = server_keys(tmp_path), client_keys(tmp_path)
    assert client.server_public == server.public
    assert zmq.curve_public(server.secret) == server.public
    assert zmq.curve_public(client.secret) == client.public != server.public
    assert server.clients == {client.public, server.public}  # every *.key of the directory


def test_keys_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_keys(tmp_path)
    before = (tmp_path / "server.key_secret").read_bytes()
    assert main(["keys", str(tmp_path)]) == 1
    assert "already holds" in capsys.readouterr().err
    assert (tmp_path / "server.key_secret").read_bytes() == before


def test_a_missing_or_public_only_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"no key file .*server\.key_secret"):
        server_keys(tmp_path)
    write_keys(tmp_path)
    (tmp_path / "client.key_secret").write_bytes((tmp_path / "client.key").read_bytes())
    with pytest.raises(KeyFileError, match="holds no secret key"):
        client_keys(tmp_path)


def test_a_network_address_needs_keys_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"--keys DIR .* or --insecure"):
        require_keys("tcp://0.0.0.0:5555", None, insecure=False)
    require_keys("tcp://0.0.0.0:5555", None, insecure=True)
    require_keys("tcp://0.0.0.0:5555", tmp_path, insecure=False)
    require_keys("ipc:///tmp/x/engine.sock", None, insecure=False)  # private to this host


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["engine", "m", "--bind", "tcp://127.0.0.1:5555"], "--keys DIR"),
        (["engine", "m"], "--bind is required"),
        (["serve", "--engine", "tcp://127.0.0.1:5555"], "--keys DIR"),
        (["serve", "m", "--engine", "tcp://e:1", "--insecure"], "give no MODEL"),
        (["serve", "--engine", "tcp://e:1", "--insecure", "--embedding-model", "x"], "its own"),
        (["engine", "m", "--bind", "tcp://e:1", "--insecure", "--heartbeat-interval", "0"], "pos"),
    ],
)
def test_bad_combinations_exit_2_with_a_reason(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_missing_key_files_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["engine", "m", "--bind", "tcp://127.0.0.1:5555", "--keys", str(tmp_path)],
        ["serve", "--engine", "tcp://127.0.0.1:5555", "--keys", str(tmp_path)],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "no key file" in capsys.readouterr().err
