"""`gentrain launch TORCHRUN_ARGS -- [PRESET] [key=value ...]`: torchrun with gentrain's exit codes.

In a pod the container's exit code is the launcher's. Plain torchrun exits 1
whatever its workers returned, so a Kubernetes podFailurePolicy could never
tell a config error (gentrain exits 2: never retry) from a crash. This
launcher validates the config before starting anything (a bad key exits 2 at
once, on every pod), then runs torchrun in this process and maps its outcome:

- the first worker to fail exited 2 (e.g. a batch the world size cannot split) -> 2;
  torchrun does not restart a worker group in which a worker exited 2 (retrying cannot help)
- the launcher got SIGTERM/SIGINT (preemption; workers saved and exited) -> 143
- any other worker failure -> 1, retried by the Job's backoffLimit
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from trainer.accelerate_env import check_accelerate_env
from trainer.config import split_preset
from trainer.errors import EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, ConfigError
from trainer.registry import load_config

log = logging.getLogger("gentrain")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise ConfigError(
            "usage: gentrain launch TORCHRUN_ARGS -- [PRESET_OR_YAML] [key=value ...] "
            "(e.g. gentrain launch --nnodes=1:2 --nproc-per-node=8 -- digits-ddpm train.lr=1e-4)"
        )
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def _agent_that_never_retries_usage_errors():
    """torchrun's LocalElasticAgent, except that a worker exiting 2 uses up every restart at once.

    Usage errors a worker only finds once it knows the world size (a batch that cannot be
    split) are as deterministic as a bad key: every rank hits them, so no agent restarts.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class UsageErrorsFailFast(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed() and any(f.exitcode == EXIT_USAGE for f in result.failures.values()):
                # Private: the agent's restart budget. No public API says "do not restart on this exit
                # code" (the fail-fast RFC pytorch/pytorch#99051 was closed unmerged); guarded by
                # tests/test_private_apis.py::test_torchrun_agent_restart_counter.
                if self._remaining_restarts > 0:
                    log.error("a worker exited %d (usage or config error): not restarting the workers", EXIT_USAGE)
                self._remaining_restarts = 0
            return result

    return UsageErrorsFailFast


ETCD_BACKENDS = ("etcd-v2", "etcd")

# torchrun's rendezvous settings gentrain launch adds where the user's --rdzv-conf does not set them. A round
# that has --nnodes MIN but not MAX members waits last_call_timeout for more before it starts: torch's 30 s,
# on top of the step watchdog's 25 s (elastic.step_timeout_seconds), put the survivors' new workers 56 s after
# a silent node's loss (bench/detection.py); with 2 s they start within 30 s, a killed node's within 20 s
# (its keep-alives, torch's 3 x 5 s, lapse first). A node that comes up later than 2 s after the others joins
# through the next round, which the running agents start when they see it waiting. A job of fixed size
# (--nnodes=N) never waits for a last call. c10d and etcd-v2 both read this key.
RDZV_DEFAULTS = {"last_call_timeout": "2"}


def with_rendezvous_defaults(conf: str) -> str:
    """torchrun's --rdzv-conf value (`k=v,k=v`) with RDZV_DEFAULTS added for the keys it does not set."""
    given = {item.partition("=")[0].strip() for item in conf.split(",") if item.strip()}
    added = [f"{k}={v}" for k, v in RDZV_DEFAULTS.items() if k not in given]
    return ",".join([conf, *added] if conf.strip() else added)


def check_rendezvous_backend(backend: str) -> None:
    """torchrun's etcd rendezvous needs python-etcd (the `etcd` extra); say so before any agent starts.

    Without it torchrun fails in its agent with a bare ImportError, on every node, and the pod
    exits 1 (retried) where a missing package can only be fixed by a new image (exit 2).
    """
    if backend not in ETCD_BACKENDS:
        return
    try:
        import etcd  # noqa: F401  (python-etcd, what torch's etcd rendezvous imports)
    except ImportError as e:
        raise ConfigError(
            f"--rdzv-backend={backend} needs python-etcd, which is not installed ({e}): pip install 'gentrain[etcd]'"
        ) from None


def launch(argv: list[str]) -> int:
    torchrun_args, train_args = split_argv(argv)
    load_config(*split_preset(train_args))  # raises ConfigError -> exit 2 before any worker starts
    check_accelerate_env(os.environ, cuda=False)  # accelerate plugins the workers would refuse (exit 2)

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun builds its agent by this module-level name; this process only launches.
    launcher_api.LocalElasticAgent = _agent_that_never_retries_usage_errors()

    # Each rendezvous round gets a fresh worker store (see trainer.elastic.init_process_group): rank 0's
    # worker hosts it at an address rank 0's agent publishes through the rendezvous (c10d's store or etcd).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args([*torchrun_args, "-m", "trainer", "train", *train_args])
    check_rendezvous_backend(args.rdzv_backend)
    args.rdzv_conf = with_rendezvous_defaults(args.rdzv_conf)
    log.info("rendezvous %s, --rdzv-conf=%s", args.rdzv_backend, args.rdzv_conf)  # what torchrun gets
    try:
        run(args)
    except ChildFailedError as e:
        # The first failure is the cause; torchrun then SIGTERMs the other workers.
        rank, first = e.get_first_failure()
        codes = sorted({f.exitcode for f in e.failures.values()})
        log.error("worker rank %s failed first with exit code %s (all: %s)", rank, first.exitcode, codes)
        return EXIT_USAGE if first.exitcode == EXIT_USAGE else 1
    except SignalException as e:
        log.warning("launcher got %s; workers were asked to checkpoint and stop", signal.Signals(e.sigval).name)
        return EXIT_PREEMPTED if e.sigval in (signal.SIGTERM, signal.SIGINT) else 128 + int(e.sigval)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
