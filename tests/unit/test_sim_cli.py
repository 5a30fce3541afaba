"""`unicron simulate`: runs without any service; bad input is one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from unicron import cli


def test_bad_trace_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,node,kind,repair_s\n1,0,ecc,0\n2,0,bit_rot,0\n")
    code = cli.main(["--coordinator", "127.0.0.1:1", "simulate", "--trace", str(trace)])
    captured = capsys.readouterr()
    assert code == cli.EXIT_USAGE
    assert captured.out == ""
    assert captured.err == f"unicron: {trace} line 3: unknown failure kind 'bit_rot'\n"


def test_unknown_strategy_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["simulate", "--strategies", "unicron,magic"])
    assert code == cli.EXIT_USAGE
    assert "unknown magic" in capsys.readouterr().err


def test_simulate_prints_a_table_and_writes_trace_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved, png = tmp_path / "trace.csv", tmp_path / "waf.png"
    args = ["simulate", "--days", "0.25", "--strategies", "unicron,megatron-cr", "--save-trace", str(saved)]
    code = cli.main([*args, "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "unicron" in out and "megatron-cr" in out and "128 GPUs" in out
    assert saved.read_text().startswith("time_s,node,kind,repair_s\n")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The saved trace replays to the same numbers.
    code = cli.main(["simulate", "--days", "0.25", "--strategies", "unicron,megatron-cr", "--trace", str(saved)])
    assert code == 0

    def numbers(text: str) -> list[list[str]]:  # every column but the wall time
        return [line.split()[:-1] for line in text.splitlines()[3:5]]

    assert numbers(capsys.readouterr().out) == numbers(out)


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code = cli.main(["--json", "simulate", "--days", "0.1", "--strategies", "unicron"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["gpus"] == 128 and data["runs"][0]["strategy"] == "unicron"


def test_simulate_the_llama3_preset_without_buddy_copies(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    args = ["--json", "simulate", "--preset", "llama3-405b", "--days", "0.5", "--strategies", "unicron"]
    code = cli.main([*args, "--replication", "1"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["gpus"] == 16_384 + 64 * 8 and data["runs"][0]["strategy"] == "unicron"
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it, exit status 2
        cli.main(["simulate", "--replication", "3"])
    assert exit_info.value.code == cli.EXIT_USAGE
