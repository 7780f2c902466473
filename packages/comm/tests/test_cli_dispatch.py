"""The `slipstream` script of slipstream-comm: `run` here, other subcommands by entry point."""

from __future__ import annotations

import pytest

from slipstream.comm import cli


class _Entry:
    def __init__(self, name: str, target: object) -> None:
        self.name, self.dist, self._target = name, None, target

    def load(self) -> object:
        return self._target


def test_registered_subcommand_gets_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    entry = _Entry("report", lambda argv: seen.append(argv) or 3)
    monkeypatch.setattr(cli, "installed_commands", lambda: {"report": entry})
    assert cli.main(["report", "--json"]) == 3
    assert seen == [["--json"]]


def test_missing_subcommand_names_the_distribution(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "installed_commands", dict)
    assert cli.main(["estimate", "--params", "1e9"]) == 2
    assert "pip install slipstream" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_run_is_the_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--help"])
    assert exit_info.value.code == 0
    assert "slipstream run" in capsys.readouterr().out


def test_help_lists_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "installed_commands", dict)
    assert cli.main(["--help"]) == 0
    assert "run " in capsys.readouterr().out
    assert isinstance(cli.installed_commands(), dict)  # the real lookup works too
