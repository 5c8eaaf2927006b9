"""bench/goodput.py's failure simulator: its invariants on small, fast inputs (issue 49, deliver 4). The
calibration against real torchrun agents is `python bench/goodput.py --calibrate` (minutes, not run here)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import goodput as g  # noqa: E402

COSTS = g.Costs(
    step_s=1.0,
    startup_s=5.0,
    compile_cold_s=20.0,
    compile_cached_s=3.0,
    compile_warm_s=2.0,
    restore_store_s=4.0,
    restore_memory_s=1.0,
    save_stall_s=2.0,
    save_write_s=5.0,
    snapshot_stall_s=0.5,
    snapshot_write_s=1.5,
    detect_process_s=2.0,
    detect_node_s=15.0,
)
MIX = {"process": 0.2, "node": 0.7, "job": 0.1}
HOUR = 3600.0


def run(lever: str, rate_per_hour: float, horizon_s: float = 200 * HOUR, seed: int = 1, durable_every_s=None):
    """The lever's Young/Daly policy against Poisson failures of a job failing `rate_per_hour` times an hour."""
    failures = g.poisson_failures(rate_per_hour / 64, 64, 8, horizon_s, MIX, seed)
    p, _ = g.policy(lever, COSTS, HOUR / rate_per_hour, MIX, HOUR, durable_every_s=durable_every_s)
    return g.simulate(COSTS, p, failures, horizon_s), failures


@pytest.mark.parametrize("lever", list(g.LEVERS))
def test_the_categories_add_up_to_the_wall_time(lever):
    out, failures = run(lever, 2.0)
    assert len(failures) > 200
    assert sum(out.seconds.values()) == pytest.approx(200 * HOUR, rel=1e-9)
    assert all(v >= -1e-6 for v in out.seconds.values()), out.seconds
    assert out.seconds["redone"] > 0 and out.seconds["detection"] > 0


def test_without_failures_goodput_is_the_productive_share_and_only_start_and_stalls_are_lost():
    p = g.Policy(memory=True, compile_cache=True, durable_every=100, memory_every=10)
    horizon = 10_000.5
    out = g.simulate(COSTS, p, [], horizon)
    start = COSTS.startup_s + COSTS.compile_cold_s  # the first start: nothing to restore, nothing compiled
    steps = out.seconds["train"] / COSTS.step_s
    assert steps == int(steps)
    stalls = steps // 100 * COSTS.save_stall_s + steps // 10 * COSTS.snapshot_stall_s
    assert out.seconds["startup"] + out.seconds["compile"] == start
    assert out.seconds["checkpoint_stall"] == pytest.approx(stalls)
    assert out.seconds["redone"] == out.seconds["detection"] == out.seconds["restore"] == 0
    assert out.goodput == pytest.approx(steps * COSTS.step_s / horizon)
    assert out.seconds["idle"] < COSTS.step_s + COSTS.save_stall_s + COSTS.snapshot_stall_s


@pytest.mark.parametrize("lever", list(g.LEVERS))
def test_doubling_the_failure_rate_never_raises_goodput(lever):
    for seed in (1, 2, 3):
        once, _ = run(lever, 1.0, seed=seed)
        twice, _ = run(lever, 2.0, seed=seed)
        assert twice.goodput < once.goodput, (seed, once.goodput, twice.goodput)


def test_the_young_daly_interval_loses_less_than_its_neighbours():
    """Durable only, the same failures for every interval: sqrt(2 C MTBF) against a third and three times it."""
    mtbf = HOUR / 2.0
    best = g.young_daly_s(COSTS.save_stall_s, mtbf)
    assert best == pytest.approx((2 * 2.0 * mtbf) ** 0.5)
    lost = {k: 1 - run("durable", 2.0, durable_every_s=best * k)[0].goodput for k in (1 / 3, 1 / 2, 1, 2, 3)}
    assert lost[1] == min(lost.values()), lost
    assert g.policy("durable", COSTS, mtbf, MIX, HOUR)[0].durable_every == round(best)


def test_a_trace_file_replays_exactly_its_failures(tmp_path):
    trace = tmp_path / "failures.csv"
    trace.write_text("time_s,node,kind\n500,3,node\n1200.5,0,process\n4000,7,job\n")
    out = tmp_path / "out.json"
    assert g.main(["--trace", str(trace), "--gpus", "64", "--hours", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for lever in g.LEVERS:
        replayed = result["results"][lever]["failures"]
        assert [(f["time_s"], f["node"], f["kind"]) for f in replayed] == [
            (500, 3, "node"),
            (1200.5, 0, "process"),
            (4000, 7, "job"),
        ]
        assert sum(result["results"][lever]["seconds"].values()) == pytest.approx(7200, abs=0.01)
    # the same failures as JSON give the same result
    doc = {
        "failures": [
            {"time_s": 500, "node": 3, "kind": "node"},
            {"time_s": 1200.5, "node": 0, "kind": "process"},
            {"time_s": 4000, "node": 7, "kind": "job"},
        ],
        "duration_s": 7200,
    }
    (tmp_path / "f.json").write_text(json.dumps(doc))
    assert g.main(["--trace", str(tmp_path / "f.json"), "--gpus", "64", "--json", str(tmp_path / "o2.json")]) == 0
    assert json.loads((tmp_path / "o2.json").read_text())["results"] == result["results"]


@pytest.mark.parametrize(
    "text, name, says",
    [
        ("when,node,kind\n1,0,node\n", "a.csv", "header time_s,node,kind"),
        ("time_s,node,kind\nsoon,0,node\n", "b.csv", "failure 1"),
        ("time_s,node,kind\n10,0,meteor\n", "c.csv", "kind='meteor'"),
        ("time_s,node,kind\n10,99,node\n", "d.csv", "node=99"),
        ("time_s,node,kind\n-5,0,node\n", "e.csv", "time_s='-5'"),
        ('{"failures": [{"time_s": 1}]', "f.json", "is not JSON"),
        ('[{"time_s": 1, "node": 0, "kind": "node"}]', "g.json", '"failures" list'),
    ],
)
def test_a_malformed_trace_file_is_one_clear_line_and_exit_2(tmp_path, capsys, text, name, says):
    trace = tmp_path / name
    trace.write_text(text)
    assert g.main(["--trace", str(trace), "--gpus", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("goodput: trace error:") and says in err[0], err


def test_the_default_table_has_every_lever_scale_and_published_rate_with_sourced_inputs(tmp_path):
    out = tmp_path / "t.json"
    assert g.main(["--min-failures", "50", "--json", str(out)]) == 0
    t = json.loads(out.read_text())
    assert set(t["results"]) == set(g.RATES) and t["default_rate"] == "meta-1024"
    for rate in t["results"].values():
        assert set(rate) == {"64", "1024", "16384"}
        for scale in rate.values():
            assert set(scale) == set(g.LEVERS)
    assert all(v["source"] for v in t["inputs"].values())
    assert t["rates"]["meta-1024"]["mtbf_hours"]["1024"] == 7.9
    assert t["rates"]["meta-16384"]["mtbf_hours"]["16384"] == 1.8
