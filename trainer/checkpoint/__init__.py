"""Checkpoints: a store that commits and discovers them, the file format, a sync/async writer,
what training state goes into which file, and the manager that decides when to save and resume.

    layout.py   every file and dir name in a checkpoint root, built and parsed
    store.py    CheckpointStore: commit (manifest last), discovery, verification, retention
    format.py   nested state <-> safetensors + JSON skeleton; streaming writer; digests
    quantized.py  8-bit optimizer state <-> plain tensors + a JSON description (never pickled)
    writer.py   Checkpointer: sync or background saves of a snapshot, one in flight
    state.py    which Stateful object goes to which file; restore from them
    weights.py  load one part's weights from any run (sampling, frozen parts)
    memory.py   the memory tier: snapshots in node-local shared memory, a buddy node's copy, the
                agreement on which step to resume from
    manager.py  CheckpointManager: when to save, resume, emergency save, failure counting
"""

from trainer.checkpoint.format import join_tensors, split_tensors, write_safetensors
from trainer.checkpoint.layout import step_dir_name
from trainer.checkpoint.store import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    Payload,
    SaveResult,
    resolve_checkpoint,
)

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "Payload",
    "SaveResult",
    "join_tensors",
    "resolve_checkpoint",
    "split_tensors",
    "step_dir_name",
    "write_safetensors",
]
