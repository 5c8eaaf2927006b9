"""Goodput (trainer.engine.goodput): every second of a run accounted for, summed across restarts, exported, and
checkpoint intervals chosen from measured costs (Young/Daly)."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request

import pytest
from conftest import REPO, clean_env, free_port, run_cli, tiny
from helpers import kill_group, start_cli, wait_for_log

from trainer.engine.goodput import (
    KINDS,
    PER_GPU_MTBF_HOURS,
    SaveSchedule,
    TimeLedger,
    default_mtbf_hours,
    interval_steps,
    parse_record,
    run_mtbf_hours,
    young_daly_seconds,
)

# ---------------------------------------------------------------------------------------------- units


def test_the_interval_is_young_dalys_optimum_in_steps():
    # sqrt(2 * 0.5 s * 2 h) = sqrt(7200) = 84.85 s; at 0.1 s a step: 849 steps.
    assert young_daly_seconds(0.5, 7200) == pytest.approx(math.sqrt(7200))
    assert interval_steps(0.5, 2.0, 0.1) == (849, False)
    assert interval_steps(0.5, 2.0, 0.1, max_minutes=30) == (849, False)
    # Cheaper saves, or failures more often: shorter intervals, as the square root says.
    assert interval_steps(0.125, 2.0, 0.1)[0] == round(849 / 2)
    assert interval_steps(0.5, 0.5, 0.1)[0] == round(848.53 / 2)
    assert interval_steps(1e-9, 1e-9, 10.0) == (1, False)  # never below one step


def test_a_durable_checkpoint_lands_at_least_every_max_interval_minutes():
    # The optimum (849 steps = 85 s) is longer than a minute: one minute of 0.1-second steps.
    assert interval_steps(0.5, 2.0, 0.1, max_minutes=1) == (600, True)
    schedule = SaveSchedule("auto", 1, False, 1.0, 2.0, 1, is_main=True)
    schedule.start(0)
    for _ in range(3):
        schedule.on_step_time(0.2)  # a minute is 300 steps
    first = schedule.decide(run_hours=0.0, failures=0)  # no save measured yet: the default (500), bounded
    assert first["durable"] == {"steps": 300, "cost_seconds": None, "bounded": True}
    schedule.apply(first)
    assert not schedule.durable_due(299) and schedule.durable_due(300)
    schedule.saved(300, "durable")
    schedule.on_cost("durable", 0.5)  # the optimum: 85 s, 424 steps
    schedule.apply(schedule.decide(run_hours=0.0, failures=0))
    assert schedule.every_steps == 300 and schedule.decision["durable"]["bounded"]
    assert schedule.durable_due(600) and not schedule.durable_due(599)


def test_the_mtbf_comes_from_the_published_rate_and_the_runs_own_failures():
    assert PER_GPU_MTBF_HOURS == pytest.approx(8089.6)
    assert default_mtbf_hours(1024) == pytest.approx(7.9)
    assert default_mtbf_hours(16384) == pytest.approx(0.494, abs=1e-3)
    assert run_mtbf_hours(10.0, 0.0, 0) == 10.0  # nothing seen yet: the prior
    assert run_mtbf_hours(10.0, 30.0, 3) == 10.0  # 3 failures in 30 h plus the prior's one in 10 h
    assert run_mtbf_hours(10.0, 90.0, 0) == 100.0  # no failure in 90 h: longer than thought
    schedule = SaveSchedule("auto", "auto", True, 30.0, None, 4, is_main=True)
    assert schedule.prior_mtbf_hours == pytest.approx(8089.6 / 4)
    schedule.on_step_time(0.2)
    schedule.on_cost("durable", 2.0)
    schedule.on_cost("memory", 0.02)
    d = schedule.decide(run_hours=1.0, failures=1)
    mtbf = (8089.6 / 4 + 1.0) / 2
    assert d["mtbf_hours"] == pytest.approx(mtbf)
    assert d["durable"]["steps"] == min(interval_steps(2.0, mtbf, 0.2)[0], 30 * 60 / 0.2)
    assert d["memory"]["steps"] == interval_steps(0.02, mtbf, 0.2)[0]  # shorter than the durable one


def test_the_decision_steps_are_the_same_on_every_rank():
    a = SaveSchedule("auto", 1, False, 30.0, 1.0, 2, is_main=True)
    b = SaveSchedule("auto", 1, False, 30.0, 1.0, 2, is_main=False)
    for s in (a, b):
        s.start(10)
    assert [n for n in range(10, 600) if a.decides_at(n, False)] == [
        n for n in range(10, 600) if b.decides_at(n, False)
    ]
    assert a.decides_at(11, False) and a.decides_at(14, False) and not a.decides_at(13, False)
    fixed = SaveSchedule(5, 1, False, 30.0, None, 1, is_main=True)
    assert not fixed.decides_at(11, True) and fixed.durable_due(10) and not fixed.durable_due(11)


def test_the_ledger_adds_up_to_the_wall_time_and_continues_a_saved_record():
    start = time.time() - 2.0  # the process started 2 s ago: start-up so far
    ledger = TimeLedger(start)
    ledger.switch("train")
    ledger.switch("data_wait")
    ledger.take("checkpoint_stall", 0.5)  # more than data_wait has: only what it has moves
    ledger.switch("idle")
    seconds = ledger.process_seconds()
    assert set(seconds) == set(KINDS)
    assert sum(seconds.values()) == pytest.approx(time.time() - start, abs=0.05)
    assert seconds["startup"] >= 1.9

    saved = parse_record(
        {"seconds": {"train": 10, "startup": "x", "bogus": 3, "idle": -1}, "processes": 2, "failures": True}
    )
    assert saved["seconds"]["train"] == 10 and saved["seconds"]["startup"] == 0 and saved["seconds"]["idle"] == 0
    assert saved["processes"] == 2 and saved["failures"] == 0 and not saved["clean_stop"]
    ledger.continue_from(saved, resumed=True, crashes=3)  # not a clean stop: a failure (3 crashes recorded)
    record = ledger.record()
    assert record["processes"] == 3 and record["failures"] == 3
    assert record["seconds"]["train"] == pytest.approx(10 + ledger.process_seconds()["train"], abs=1e-3)
    clean = TimeLedger(time.time())
    clean.continue_from({**saved, "clean_stop": True}, resumed=True, crashes=0)
    assert clean.record()["failures"] == 0
    ledger.redo_until = 7
    assert ledger.step_kind(6) == "redone" and ledger.step_kind(7) == "train"
    assert parse_record(None) is None and parse_record({"seconds": [1]}) is None


def test_the_dashboard_shows_goodput_and_the_time_by_kind():
    dash = json.loads((REPO / "k8s" / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    assert "gentrain_goodput" in exprs and "gentrain_time_seconds_total" in exprs


# ---------------------------------------------------------------------------------------------- real runs

_PROCESS = re.compile(r"time of this process \(s\): (.*) goodput=([\d.]+)")
_RUN = re.compile(r"time of the run \(s, (\d+) process\(es\), (\d+) failure\(s\)\): (.*) goodput=([\d.]+)")


def _kinds(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", text)}


def _stored(root, step: int) -> dict:
    doc = json.loads((root / f"step-{step:09d}" / "trainer.json").read_text())
    return doc["progress"]["goodput"]


def _scrape_times(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    times = {k: float(v) for k, v in re.findall(r'^gentrain_time_seconds_total\{kind="(\w+)"\} (\S+)$', text, re.M)}
    goodput = re.search(r"^gentrain_goodput (\S+)$", text, re.M)
    return {**times, "goodput": float(goodput.group(1)) if goodput else -1.0}


def _train(tmp_path, name: str, max_steps: int, port: int) -> tuple[str, dict[str, float], float]:
    """A real `gentrain train` (metrics on, lingering): its log, the scraped times, its wall time from outside."""
    log = tmp_path / f"{name}.log"
    args = tiny(
        tmp_path,
        "checkpoint.every_steps=2",
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "metrics.linger_seconds=60",
        max_steps=max_steps,
    )
    t0 = time.time()
    proc = start_cli("train", *args, env=clean_env(), log_path=log)
    try:
        text = wait_for_log(log, "time of the run", proc)
        scraped = _scrape_times(port)
    finally:
        kill_group(proc)
    return text, scraped, time.time() - t0


def _check_adds_up(text: str, outside: float) -> dict[str, float]:
    kinds = _kinds(_PROCESS.search(text).group(1))
    wall = kinds.pop("wall")
    assert set(kinds) == set(KINDS)
    assert sum(kinds.values()) == pytest.approx(wall, abs=0.01 * len(kinds))  # printed to 0.01 s each
    startup = json.loads(re.search(r"startup timings \(s\): (\{.*\})", text).group(1))
    assert startup["total"] - 0.05 <= wall <= outside + 0.05  # the process's whole life, and no more
    assert kinds["train"] > 0 and kinds["restore"] >= 0
    return kinds


@pytest.mark.slow
def test_every_second_is_accounted_for_summed_across_a_restart_exported_and_printed(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    port = free_port()
    text, scraped, outside = _train(tmp_path, "first", 4, port)
    _check_adds_up(text, outside)
    stored = _stored(root, 4)
    assert stored["processes"] == 1 and stored["failures"] == 0 and stored["clean_stop"] is True
    assert set(stored["seconds"]) == set(KINDS)
    # The exporter has every kind, rank 0's, and the goodput of the run.
    assert set(KINDS) <= set(scraped) and scraped["train"] > 0 and 0 < scraped["goodput"] < 1

    text, scraped, outside = _train(tmp_path, "resumed", 8, port)
    second = _check_adds_up(text, outside)
    assert second["restore"] > 0  # it resumed
    processes, failures, run_kinds, _ = _RUN.search(text).groups()
    assert (int(processes), int(failures)) == (2, 0)  # the first one stopped cleanly
    run = _kinds(run_kinds)
    run_wall = run.pop("wall")
    # The run's sums continue the checkpoint's: step 4's record plus this whole process.
    assert run_wall == pytest.approx(sum(stored["seconds"].values()) + sum(second.values()), abs=0.1)
    assert scraped["startup"] >= stored["seconds"]["startup"] + second["startup"] - 0.05
    assert sum(v for k, v in scraped.items() if k in KINDS) >= sum(stored["seconds"].values())
    final = _stored(root, 8)
    assert final["processes"] == 2
    assert sum(final["seconds"].values()) > sum(stored["seconds"].values())
    assert final["seconds"]["train"] >= stored["seconds"]["train"] + second["train"] * 0.5

    r = run_cli("runs", "goodput", str(root))
    assert r.returncode == 0, r.stderr
    table = r.stdout
    assert "at step 8" in table and "over 2 processes, 0 failure(s)" in table
    for kind in KINDS:
        assert re.search(rf"^{kind} +{final['seconds'][kind]:.2f} ", table, re.M), (kind, table)
    wall = float(re.search(r"^wall +([\d.]+)", table, re.M).group(1))
    assert wall == pytest.approx(sum(final["seconds"].values()), abs=0.01)
    assert f"goodput {final['seconds']['train'] / sum(final['seconds'].values()):.4f}" in table

    bad = run_cli("runs", "goodput", str(tmp_path / "nothing-here"))
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "holds no valid checkpoint" in bad.stderr


@pytest.mark.slow
def test_auto_intervals_follow_the_measured_costs_and_the_run_saves_at_them(tmp_path):
    steps = 80
    args = tiny(
        tmp_path,
        "checkpoint.every_steps=auto",
        # 0.06 s: the first save comes within the run on a CPU up to ~20x faster than one at 14 ms a step (the
        # default interval is this bound in steps: 0.6 s was 43 steps here, past a 40-step run)
        "checkpoint.max_interval_minutes=0.001",
        "elastic.mtbf_hours=0.0002",  # 0.72 s between failures: intervals of a few steps
        "checkpoint.keep=1000",
        max_steps=steps,
    )
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    decisions = [ln for ln in lines if "checkpoint interval (auto)" in ln]
    assert decisions, r.stderr[-3000:]
    # Until a save is measured: the default, bounded by checkpoint.max_interval_minutes.
    assert "default until a save is measured" in decisions[0]
    assert "bounded by checkpoint.max_interval_minutes=0.001" in decisions[0]
    measured = [ln for ln in decisions if "sqrt(2 * cost" in ln]
    assert measured, decisions
    for line in measured:  # each logged with its inputs, and the interval is the formula's on them
        every = int(re.search(r"checkpoint\.every_steps=(\d+)", line).group(1))
        cost = float(re.search(r"cost ([\d.e-]+) s", line).group(1))
        mtbf = float(re.search(r"mtbf_hours=([\d.e-]+)", line).group(1))
        step_s = float(re.search(r"step_seconds=([\d.e-]+)", line).group(1))
        assert "prior 0.0002 h from elastic.mtbf_hours" in line
        want, bounded = interval_steps(cost, mtbf, step_s, max_minutes=0.001)
        assert abs(every - want) <= 1, line  # the inputs are printed rounded
        assert bounded == ("bounded by" in line), line

    # The saves follow the decisions: each one the interval in force after the one before.
    every, last, expected = None, 0, []
    for ln in lines:
        if "checkpoint interval (auto)" in ln:
            every = int(re.search(r"checkpoint\.every_steps=(\d+)", ln).group(1))
        elif m := re.search(r" step=(\d+)/", ln):
            step = int(m.group(1))
            if every is not None and step < steps and step >= last + every:
                expected.append(step)
                last = step
            elif every is None and step >= 500:
                expected.append(step)
    saved = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved[-1] == steps and len(saved) >= 3, saved
    assert saved[:-1] == expected, (saved, expected)
