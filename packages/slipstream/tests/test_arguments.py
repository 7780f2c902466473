"""Tests of add_config_arguments: DeepSpeed's flags, the --slipstream_config alias, legacy names."""

from __future__ import annotations

import argparse

import pytest

import slipstream
from slipstream.arguments import add_config_arguments


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--lr", type=float, default=0.1)
    return add_config_arguments(parser).parse_args(argv)


def test_returns_the_same_parser() -> None:
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser


def test_defaults() -> None:
    args = parse([])
    assert args.deepspeed is False
    assert args.deepspeed_config is None
    assert args.deepscale is False
    assert args.deepscale_config is None
    assert args.deepspeed_mpi is False
    assert not hasattr(args, "slipstream_config")


def test_deepspeed_flags() -> None:
    args = parse(["--deepspeed", "--deepspeed_config", "ds.json", "--lr", "0.5"])
    assert args.deepspeed is True
    assert args.deepspeed_config == "ds.json"
    assert args.lr == 0.5


def test_slipstream_config_is_an_alias_with_the_same_dest() -> None:
    assert parse(["--slipstream_config", "ss.json"]).deepspeed_config == "ss.json"
    # Like any repeated option, the last one given wins.
    assert (
        parse(["--deepspeed_config", "a.json", "--slipstream_config", "b.json"]).deepspeed_config
        == "b.json"
    )


def test_legacy_deepscale_flags_keep_their_own_attributes() -> None:
    args = parse(["--deepscale", "--deepscale_config", "old.json"])
    assert args.deepscale is True
    assert args.deepscale_config == "old.json"
    assert args.deepspeed_config is None


def test_mpi_flag() -> None:
    assert parse(["--deepspeed_mpi"]).deepspeed_mpi is True


def test_a_config_flag_needs_a_value() -> None:
    with pytest.raises(SystemExit):
        parse(["--deepspeed_config"])


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    for flag in ("--deepspeed ", "--deepspeed_config", "--slipstream_config", "--deepscale_config"):
        assert flag in out


def test_exported_from_the_package() -> None:
    assert slipstream.add_config_arguments is add_config_arguments
