"""Where the test suite's CPU goes, per test file: the log of a run made with GENTRAIN_TEST_CPU_LOG.

    GENTRAIN_TEST_CPU_LOG=/tmp/cpu.jsonl bash scripts/test.sh
    python scripts/suite_cpu.py /tmp/cpu.jsonl [--top 40] [--tests]

Columns: all CPU seconds the file's tests used; of which forked runs (tests/zygote.py: CLI runs, torchrun's
agents and ranks, bench scripts), the pytest process itself, and the processes it started and waited for
(fresh interpreters: a venv of another install, a run with its own import-time settings, torchx's pods);
the number of forked runs; the summed wall time of the tests. A forked run costs about 1 s of CPU for a
tiny CLI run, a fresh interpreter 5 s more (its imports): a file with much `fresh` CPU is the first place
to look. `--tests` lists single tests by their fresh-interpreter CPU instead.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter


def _file(test: str) -> str:
    return test.split("::", 1)[0].removeprefix("tests/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--tests", action="store_true", help="single tests by fresh-interpreter CPU")
    args = parser.parse_args()
    fork, forks, own, fresh, wall = Counter(), Counter(), Counter(), Counter(), Counter()
    per_test = []
    with open(args.log) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line a killed writer left half-written
            name = _file(r["test"])
            if r["kind"] == "fork":
                fork[name] += r["cpu"]
                forks[name] += 1
            else:
                own[name] += r["self"]
                fresh[name] += r["children"]
                wall[name] += r["wall"]
                per_test.append((r["children"], r["self"], r["wall"], r["test"]))
    if args.tests:
        print(f"{'fresh':>7} {'pytest':>7} {'wall':>7}  test")
        for children, self_, w, test in sorted(per_test, reverse=True)[: args.top]:
            print(f"{children:7.1f} {self_:7.1f} {w:7.1f}  {test}")
        return
    total = {name: fork[name] + own[name] + fresh[name] for name in {*fork, *own}}
    print(
        f"CPU minutes: {sum(total.values()) / 60:.1f} (forked runs {sum(fork.values()) / 60:.1f}, pytest "
        f"{sum(own.values()) / 60:.1f}, fresh interpreters {sum(fresh.values()) / 60:.1f}); tests' wall "
        f"{sum(wall.values()) / 60:.1f}"
    )
    print(f"{'file':42} {'cpu':>6} {'forked':>6} {'pytest':>6} {'fresh':>6} {'forks':>5} {'wall':>6}")
    for name, cpu in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        print(
            f"{name:42} {cpu:6.0f} {fork[name]:6.0f} {own[name]:6.0f} {fresh[name]:6.0f} {forks[name]:5d} "
            f"{wall[name]:6.0f}"
        )


if __name__ == "__main__":
    main()
