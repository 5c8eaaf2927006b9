"""Errors every layer raises and the exit codes they map to (a leaf module: it imports nothing of gentrain).

The CLI turns a `ConfigError` (and its kinds: a store that refuses the final save, a crash loop) into one
line on stderr and `EXIT_USAGE`; a checkpoint that cannot be read or written (`CheckpointError`) into one line
and `EXIT_INVALID_CHECKPOINT`; a worker stopped by SIGTERM exits `EXIT_PREEMPTED`; one whose training step hung
past `elastic.step_timeout_seconds` exits `EXIT_STEP_TIMEOUT` (trainer.elastic.StepWatchdog).
"""

EXIT_OK = 0
EXIT_INVALID_CHECKPOINT = 1
EXIT_USAGE = 2
# A worker whose training step did not finish within elastic.step_timeout_seconds (a lost or silent peer holds
# a collective): a failure torchrun retries, like a crash, told apart from one in the logs and the agent's record.
EXIT_STEP_TIMEOUT = 3
EXIT_PREEMPTED = 143  # 128 + SIGTERM, what Kubernetes and torchrun expect from a stopped worker


class ConfigError(ValueError):
    """A user error in the config, a flag or an input; the CLI prints it and exits 2."""

    label = "config error"  # how the CLI's one line starts


class StoreRefusesWrites(ConfigError):
    """The checkpoint store refused the final save for good (read-only, no permission, full): retrying would
    train the same steps again and fail the same way, so it is exit 2, with the last good checkpoint kept."""

    label = "store error"


class CrashLoop(ConfigError):
    """The same crash, at the same place, from the same resume point, for the third time in a row with nothing
    committed in between (trainer.engine.attempts): exit 2, so no orchestrator restarts it again."""

    label = "crash loop"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's file does not match its manifest (size, digest or structure)."""
