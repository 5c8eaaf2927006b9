"""Checkpoint errors (a leaf module: the store, the validity rules and the readers all raise these)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's file does not match its manifest (size, digest or structure)."""
