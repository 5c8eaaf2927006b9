"""Every name inside a checkpoint root, built and parsed in one place.

    <root>/lease.json                         the trainer that owns the root now (trainer.checkpoint.lease)
    <root>/attempts.json                      the last crashed training process's resume point and crash
                                              (trainer.checkpoint.attempts: ends crash loops)
    <root>/step-000001200/                    one checkpoint (step_dir_name / parse_step_dir)
        manifest.json                         written last: the commit point
        trainer.json                          steps, optimizer skeletons, data cursor, config
        <part>.model.safetensors              online weights          } one file per group,
        <part>.ema.safetensors                EMA weights only        } `<part>.<kind>`
        <part>.optimizer.safetensors          optimizer tensors       }
        rank-NNNNN.safetensors / .json        each rank's RNG state
    sharded (FSDP) checkpoints hold each group as
        <part>.<kind>.rank-NNNNN.safetensors  rank N's slices
        <part>.<kind>.replicated.safetensors  tensors every rank holds whole (rank 0 writes them)
        shards.json                           where every slice of every tensor lies
    the memory tier (trainer.checkpoint.memory) keeps the same names in a node's shared memory, plus
        piece-rNNNNN.json                     commit point of rank N's piece (its files), written last

The state, weights, sharded and store modules build and recognise names only through this
module, so a file kind is added or renamed here and nowhere else. It imports nothing of
gentrain's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

MANIFEST = "manifest.json"
TRAINER_JSON = "trainer.json"
SHARD_INDEX = "shards.json"
LEASE_FILE = "lease.json"  # beside the step dirs, while a trainer holds the root
ATTEMPTS_FILE = "attempts.json"  # beside the step dirs: the last crash and where it resumed from (rank 0 writes)
KINDS = ("model", "ema", "optimizer")  # the kinds of tensor group a part has

_PIECE = re.compile(r"^piece-r(\d{5,})\.json$")
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_RANK_STATE = re.compile(r"^rank-(\d{5,})\.(safetensors|json)$")
# <part>.<kind>.safetensors | <part>.<kind>.rank-NNNNN.safetensors | <part>.<kind>.replicated.safetensors;
# a part name has no dot (config keys are identifiers), so the first dot ends it.
_GROUP_FILE = re.compile(r"^([^.]+)\.(model|ema|optimizer)(?:\.rank-(\d{5,})|\.(replicated))?\.safetensors$")


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def piece_file(owner: int) -> str:
    """The memory tier's commit point of the piece rank `owner` contributes to a step."""
    return f"piece-r{owner:05d}.json"


def parse_piece_file(name: str) -> int | None:
    """The owner rank of a piece file's base name, or None for any other name."""
    m = _PIECE.match(name)
    return int(m.group(1)) if m else None


def eval_result_name(step: int) -> str:
    """`gentrain eval`'s result for a step: beside the step dirs in the root (retention leaves it alone)."""
    return f"eval-{step:09d}.json"


def parse_step_dir(name: str) -> int | None:
    """The step of a step dir's base name, or None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def group_name(part: str, kind: str) -> str:
    """The tensor group `<part>.<kind>` (kind one of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown tensor group kind {kind!r} (one of {', '.join(KINDS)})")
    return f"{part}.{kind}"


def whole_file(group: str) -> str:
    """The one file holding a whole group (an unsharded checkpoint)."""
    return f"{group}.safetensors"


def model_file(part: str) -> str:
    return whole_file(group_name(part, "model"))


def ema_file(part: str) -> str:
    return whole_file(group_name(part, "ema"))


def optimizer_file(part: str) -> str:
    return whole_file(group_name(part, "optimizer"))


def shard_file(group: str, rank: int) -> str:
    return f"{group}.rank-{rank:05d}.safetensors"


def replicated_file(group: str) -> str:
    return f"{group}.replicated.safetensors"


def rank_files(rank: int) -> tuple[str, str]:
    """Rank `rank`'s RNG state: tensors, then values."""
    return f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"


def is_tensor_file(name: str) -> bool:
    """A payload file of tensors (safetensors); every other payload file is JSON."""
    return name.endswith(".safetensors")


def is_rank_json(name: str) -> bool:
    m = _RANK_STATE.match(name)
    return bool(m) and m.group(2) == "json"


def is_rank_tensors(name: str) -> bool:
    m = _RANK_STATE.match(name)
    return bool(m) and m.group(2) == "safetensors"


@dataclass(frozen=True)
class GroupFile:
    """What a tensor-group file name says: whose, which kind, and which slice."""

    part: str
    kind: str
    rank: int | None = None  # the rank whose slices it holds (sharded)
    replicated: bool = False  # the tensors every rank holds whole (sharded)

    @property
    def group(self) -> str:
        return f"{self.part}.{self.kind}"

    @property
    def whole(self) -> bool:
        return self.rank is None and not self.replicated


def parse_group_file(name: str) -> GroupFile | None:
    """The part, kind and slice a file name holds, or None for a file that is not a tensor group's."""
    m = _GROUP_FILE.match(name)
    if not m:
        return None
    return GroupFile(m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None, m.group(4) is not None)


def parse_group(name: str) -> GroupFile | None:
    """The part and kind of a group name (`unet.ema`) or of any file of it, or None for anything else."""
    part, _, kind = name.rpartition(".")
    if part and "." not in part and kind in KINDS:
        return GroupFile(part, kind)
    return parse_group_file(name)


def group_files(names: Iterable[str], group: str) -> list[str]:
    """The files among `names` that hold (slices of) `group`: its whole file, or its shards, sorted."""
    names = list(names)
    if whole_file(group) in names:
        return [whole_file(group)]
    found = [n for n in names if (g := parse_group_file(n)) is not None and g.group == group and not g.whole]
    return sorted(found)


def parts_with_weights(names: Iterable[str]) -> list[str]:
    """The parts whose online weights are among `names` (whole or sharded), sorted."""
    return sorted({g.part for n in names if (g := parse_group_file(n)) is not None and g.kind == "model"})
