"""Checkpoints, the storage library: a store that commits and discovers them, the file format, a sync/async
writer, what training state goes into which file, sharded files, the lease and the memory tier.

It sits at the bottom of the layers, beside `trainer.storage`: it imports nothing of trainer but `config`,
`elastic`, `storage`, `randomness`, `errors` and the leaf `ema` (validity.py vets a stored EMA state with it)
(tests/test_layers.py). When to save and what to resume from
is the engine's (`trainer/engine/checkpoints.py`, CheckpointManager).

    layout.py   every file and dir name in a checkpoint root, built and parsed
    reader.py   CheckpointReader: discovery, verification, reads (writes nothing)
    retention.py  which old checkpoints go after a commit; removing a step dir
    store.py    CheckpointStore: commit (manifest last), on top of the reader and retention
    view.py     CheckpointView: one checkpoint read-only (part weights, digests, part steps, config tree)
    format.py   nested state <-> safetensors + JSON skeleton; streaming writer; digests
    quantized.py  8-bit optimizer state <-> plain tensors + a JSON description (never pickled)
    writer.py   Checkpointer: sync or background saves of a snapshot, one in flight
    state.py    which Stateful object goes to which file; restore from them
    sharded.py  a sharded (FSDP) checkpoint: every rank's slices, their index, reading them at any world size
    lease.py    one trainer per run: an exclusive, renewed lease on a checkpoint root, checked before commits
    attempts.py attempts.json: the last crash and its resume point, read as data only (the engine counts them)
    validity.py what a valid checkpoint is: manifest, payload and JSON state schemas, checked before use
    memory.py   the memory tier: snapshots in node-local shared memory, a buddy node's copy, the
                agreement on which step to resume from
"""

from trainer.checkpoint.format import join_tensors, split_tensors, write_safetensors
from trainer.checkpoint.layout import step_dir_name
from trainer.checkpoint.reader import CheckpointReader, InvalidCheckpoint
from trainer.checkpoint.store import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    Payload,
    SaveResult,
    resolve_checkpoint,
)
from trainer.checkpoint.view import CheckpointView, candidate_views

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointReader",
    "CheckpointStore",
    "CheckpointView",
    "InvalidCheckpoint",
    "Payload",
    "SaveResult",
    "candidate_views",
    "join_tensors",
    "resolve_checkpoint",
    "split_tensors",
    "step_dir_name",
    "write_safetensors",
]
