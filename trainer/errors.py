"""Errors every layer raises and the exit codes they map to (a leaf module: it imports nothing of gentrain).

The CLI turns a `ConfigError` into one line on stderr and `EXIT_USAGE`; a checkpoint that cannot be
read (`CheckpointError`) into `EXIT_INVALID_CHECKPOINT`; a worker stopped by SIGTERM exits `EXIT_PREEMPTED`.
"""

EXIT_OK = 0
EXIT_INVALID_CHECKPOINT = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 143  # 128 + SIGTERM, what Kubernetes and torchrun expect from a stopped worker


class ConfigError(ValueError):
    """A user error in the config, a flag or an input; the CLI prints it and exits 2."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's file does not match its manifest (size, digest or structure)."""
