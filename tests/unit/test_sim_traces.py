"""Failure traces: generator statistics, presets, CSV round trip, and bad input by line."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import unicron_sim as sim
from unicron.errors import InvalidArgument
from unicron.failures import TAXONOMY, kind_name
from unicron.v1 import common_pb2 as pb
from unicron_sim import runner, traces


def _big_trace(seed: int = 1) -> tuple[traces.TraceConfig, list[traces.FailureEvent]]:
    config = traces.TraceConfig(nodes=200, days=5.0, failure_rate_per_node_per_s=1 / 3600.0, seed=seed)
    return config, traces.generate(config)


def test_generator_rate_and_mix_match_the_config() -> None:
    config, events = _big_trace()
    expected = config.failure_rate_per_node_per_s * config.nodes * config.duration_s
    assert abs(len(events) - expected) < 0.03 * expected
    shares = traces.normalized_mix(traces.DEFAULT_MIX)
    counts = Counter(e.kind for e in events)
    for kind, share in shares.items():
        assert abs(counts[kind] / len(events) - share) < 0.01, kind_name(kind)  # type: ignore[arg-type]
    assert all(0 <= e.node < config.nodes for e in events)
    assert [e.time_s for e in events] == sorted(e.time_s for e in events)
    assert all(e.time_s < config.duration_s for e in events)
    mean_repair = sum(e.repair_s for e in events) / len(events)
    assert abs(mean_repair - config.repair_mean_s) < 0.03 * config.repair_mean_s


def test_generator_is_deterministic_by_seed() -> None:
    assert _big_trace(3)[1] == _big_trace(3)[1]
    assert _big_trace(3)[1] != _big_trace(4)[1]


def test_default_mix_names_map_onto_the_taxonomy() -> None:
    assert set(traces.MIX_NAMES) == set(traces.DEFAULT_MIX)
    assert all(kind in TAXONOMY for kind in traces.MIX_NAMES.values())
    assert traces.kind_of("nccl_timeout") == pb.FAILURE_KIND_COLLECTIVE_TIMEOUT
    assert traces.kind_of("ecc_error") == traces.kind_of("ecc") == pb.FAILURE_KIND_ECC_ERROR
    assert traces.kind_of("node_lost") == pb.FAILURE_KIND_NODE_LOST


def test_meta_preset_matches_llama3_figures() -> None:
    preset = traces.PRESETS["meta-16k"]
    expected = preset.failure_rate_per_node_per_s * (preset.gpus / 8) * preset.days * traces.DAY_S
    assert expected == pytest.approx(419)
    shares = traces.normalized_mix(preset.mix)
    assert sum(p for k, p in shares.items() if traces.is_hardware(k)) == pytest.approx(0.78)


def test_csv_round_trip_is_exact(tmp_path: Path) -> None:
    _, events = _big_trace()
    path = tmp_path / "trace.csv"
    traces.save_csv(path, events[:300])
    assert traces.load_csv(path, 200) == events[:300]


def test_csv_accepts_both_namings_comments_and_no_header() -> None:
    text = "# a comment\n\n1.5,0,nccl_timeout,0\n2,1,ECC_ERROR,60\n2,1,gpu_driver,1e3\n"
    events = traces.parse_csv(text, 2)
    assert [e.kind for e in events] == [
        pb.FAILURE_KIND_COLLECTIVE_TIMEOUT,
        pb.FAILURE_KIND_ECC_ERROR,
        pb.FAILURE_KIND_GPU_DRIVER_ERROR,
    ]
    assert events[2].repair_s == 1000.0


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("20,1,cosmic_ray,0", "unknown failure kind 'cosmic_ray'"),
        ("5,1,ecc,0", "time_s 5 is before the previous event's 10"),
        ("20,16,ecc,0", "unknown node 16 (the cluster has nodes 0..15)"),
        ("20,-1,ecc,0", "unknown node -1"),
        ("20,n1,ecc,0", "node 'n1' is not a node index"),
        ("20,1,ecc", "expected 4 fields"),
        ("20,1,ecc,0,9", "expected 4 fields"),
        ("soon,1,ecc,0", "time_s 'soon' is not a number"),
        ("20,1,ecc,-3", "repair_s must be a finite number >= 0"),
        ("inf,1,ecc,0", "time_s must be a finite number >= 0"),
        ('20,1,"ecc,0', "expected 4 fields"),
    ],
)
def test_bad_line_is_named_and_nothing_is_simulated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, problem: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(f"time_s,node,kind,repair_s\n10,0,ecc,60\n{line}\n30,2,ecc,0\n")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("simulated a bad trace")

    monkeypatch.setattr(sim, "simulate", never)
    monkeypatch.setattr(runner, "simulate_one", never)
    with pytest.raises(InvalidArgument) as caught:
        sim.run(sim.Scenario(trace_file=path))
    assert str(caught.value).startswith(f"{path} line 3: ")
    assert problem in str(caught.value)


def test_missing_trace_file_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        sim.run(sim.Scenario(trace_file=tmp_path / "nope.csv"))


def test_trace_config_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="nodes"):
        traces.TraceConfig(nodes=0, days=1, failure_rate_per_node_per_s=0.0)
    with pytest.raises(InvalidArgument, match="unknown failure kind"):
        traces.TraceConfig(nodes=1, days=1, failure_rate_per_node_per_s=0.0, mix={"gremlins": 1.0})
