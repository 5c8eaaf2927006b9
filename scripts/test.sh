#!/usr/bin/env bash
# Fresh virtualenv with the test extras, system tools the tests drive (prometheus,
# promtool, etcd), then the whole suite. This is what CI runs (.ci/run).
# Extra arguments go to pytest, e.g. scripts/test.sh -k checkpoint
# Two pytest-xdist workers, one test file each at a time (module fixtures stay shared): most tests
# wait on processes they start, so two overlap well even on 2 cores. GENTRAIN_TEST_WORKERS=0 runs
# everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-test}
python3 -m venv "$VENV"
# Bytecode: this machine and CI set PYTHONDONTWRITEBYTECODE=1, so Python never caches what it compiles on
# import, and without .pyc files every process the suite starts would compile torch's and diffusers' sources
# again (import torch + diffusers: 7.5 s instead of 4.1 s, times the ~1,000 processes the suite starts). pip
# compiles every module it installs, one at a time (62 of its 114 s of CPU here), most of them never imported;
# so pip installs without bytecode, and the suite runs without PYTHONDONTWRITEBYTECODE: the first process that
# imports a module caches its bytecode, the others read it. gentrain's own code and the test helpers are
# compiled up front (compileall, on both cores).
"$VENV/bin/pip" install -q --no-compile torch==2.13.0
"$VENV/bin/pip" install -q --no-compile -c constraints.txt -e ".[test]"
"$VENV/bin/python" -m compileall -q -j 0 trainer tests bench >/dev/null
"$VENV/bin/pip" check
# etcd: the server of torchrun's etcd-v2 rendezvous (tests/test_etcd.py; Debian's 3.4 speaks the v2 API).
APT_PACKAGES=()
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then APT_PACKAGES+=(prometheus); fi
if ! command -v etcd >/dev/null; then APT_PACKAGES+=(etcd-server); fi
if [ ${#APT_PACKAGES[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}" >/dev/null
fi
export PATH="$PWD/$VENV/bin:$PATH"
unset PYTHONDONTWRITEBYTECODE  # see the install above
exec "$VENV/bin/python" -m pytest -n "${GENTRAIN_TEST_WORKERS:-2}" --dist loadfile --durations=30 "$@"
