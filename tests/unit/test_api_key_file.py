"""`omnistage serve --api-key-file FILE`: the keys come from a file, so the process list shows only its path."""

from __future__ import annotations

import pytest

from omnistage.local.cli import build_parser


def test_keys_from_a_file_join_those_given_as_flags(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the operators' key\nops-key:7\n\n  plain-key  \n")
    args = build_parser().parse_args(["serve", "p.yaml", "--api-key", "flag-key", "--api-key-file", str(keys)])
    assert args.api_key == ["flag-key", "ops-key:7", "plain-key"]
    assert build_parser().parse_args(["serve", "p.yaml"]).api_key == []


def test_an_unreadable_key_file_is_a_usage_error_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "p.yaml", "--api-key-file", str(tmp_path / "absent")])
    assert e.value.code == 2
    assert f"--api-key-file: cannot read {tmp_path / 'absent'}" in capsys.readouterr().err
