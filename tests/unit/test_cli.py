"""The CLI's error paths: one readable line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from unicron import cli
from unicron.redisutil import free_port


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unreachable_coordinator_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, out, err = run(capsys, "--coordinator", address, "jobs")
    assert code == cli.EXIT_FAILED
    assert err == f"unicron: cannot reach the coordinator at {address} (is it running?)\n"
    assert out == ""


def test_bad_spec_is_reported_before_any_rpc(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\nmodel: {hidden_size: 30, num_attention_heads: 4}\n")
    code, _, err = run(capsys, "--coordinator", f"127.0.0.1:{free_port()}", "submit", str(spec))
    assert code == cli.EXIT_USAGE
    assert err.startswith("unicron: spec.model.num_layers: ") and err.count("\n") == 1


def test_missing_spec_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "submit", str(tmp_path / "nope.yaml"))
    assert code == cli.EXIT_USAGE and "cannot read" in err and "Traceback" not in err
