"""`characters serve`'s database options (deployments.cli.serve): where the state goes by default, what a config
or the environment changes, and a database that cannot be used stopping the start (exit 2, the password never
printed) before Ray is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.cli.serve import _with_state, build_parser, default_data_dir, run_serve


def test_the_state_goes_to_the_data_dir_unless_a_url_or_the_config_says_otherwise(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("CHARACTERS_DATA_DIR", raising=False)
    monkeypatch.delenv("CHARACTERS_DATABASE_URL", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == str(tmp_path / "xdg" / "characters")
    assert _with_state({}, None, None) == {"service": {"data_dir": str(tmp_path / "xdg" / "characters")}}
    assert _with_state({"api": {}}, str(tmp_path / "d"), None) == {"api": {},
                                                                    "service": {"data_dir": str(tmp_path / "d")}}
    pg = "postgresql+psycopg://u@h/db"
    assert _with_state({}, None, pg) == {"service": {"database_url": pg}}
    kept = {"service": {"database_url": "sqlite:////x.db", "preset": "tiny"}}
    assert _with_state(kept, str(tmp_path / "d"), None) == kept  # the config's own choice
    monkeypatch.setenv("CHARACTERS_DATA_DIR", str(tmp_path / "env"))
    assert default_data_dir() == str(tmp_path / "env")
    monkeypatch.setenv("CHARACTERS_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert _with_state({}, None, None) == {"service": {}}  # ServiceConfig.from_env reads it
    a = build_parser().parse_args(["--data-dir", "/srv/characters", "--database-url", "sqlite:///x.db"])
    assert (a.data_dir, a.database_url) == ("/srv/characters", "sqlite:///x.db")


def test_a_database_that_cannot_be_used_stops_the_start_with_exit_2(capsys, monkeypatch, tmp_path: Path) -> None:
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "RAY_ADDRESS",
                 "CHARACTERS_DATA_DIR", "CHARACTERS_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)  # run_serve sets some: restored after the test
    url = "postgresql+psycopg://characters:s3cret-pw@127.0.0.1:1/characters"  # nothing listens on port 1
    assert run_serve(port=0, grpc_port=0, database_url=url) == 2
    err = capsys.readouterr().err
    assert "cannot be opened and migrated" in err and "127.0.0.1:1" in err and "s3cret-pw" not in err
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert run_serve(port=0, grpc_port=0, data_dir=str(blocked / "data")) == 2
    assert "cannot be created" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data-dir"])
