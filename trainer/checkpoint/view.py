"""CheckpointView: one committed checkpoint, read-only, with its manifest interpreted in one place.

A manifest's keys are the store's format (docs/contract.md, "Checkpoint layout"), not an API: every
reader outside `trainer.checkpoint` (sampling, export, `verify` and `list`, a frozen part's source run, a
resume's checks of its inputs and of who wrote the newest step) asks a view what the checkpoint holds: a
part's weights and their digest, the digests of what the run was trained with (its text encoder under
`inputs`, its frozen parts such as an autoencoder under `frozen`), each part's step, who wrote it, and the
run's config. `tests/test_checkpoint_view.py` keeps every other module from reading `info.manifest`.

What a view derives is derived once: trainer.json (the part steps) is read once, and the run's parsed
config is kept by `derived`. The config is parsed above this layer (`trainer.runs.config_of`: it needs
the task registry, which `checkpoint/` must not import), so the view hands out the stored tree and keeps
what the parser made of it.

Limits: a view is of one commit of one step (`info`, checked by its reader) and never writes. Its manifest
is whatever the store held, so the caller decides what to trust: a config from it never chooses which
code runs (`trainer.registry.check_stored_task`), and its storage options are redacted.
"""

from __future__ import annotations

import copy
import logging
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from trainer.checkpoint.format import new_digest, torch_dtype
from trainer.checkpoint.layout import (
    SHARD_INDEX,
    TRAINER_JSON,
    group_files,
    group_name,
    parse_group,
    parse_step_dir,
    parts_with_weights,
    whole_file,
)
from trainer.checkpoint.reader import CheckpointInfo, CheckpointReader
from trainer.checkpoint.sharded import ShardIndex, load_group
from trainer.checkpoint.store import describe_owner
from trainer.checkpoint.validity import FrozenRecord, InputRecord, TrainerState
from trainer.errors import CheckpointCorrupt, ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

# What the store itself writes into every manifest; the rest is what the run recorded about itself.
_BOOKKEEPING = ("format_version", "step", "time_utc", "digest", "files")


class CheckpointView:
    """Read-only view of one committed checkpoint: identity, files and digests, part weights and steps,
    the recorded config, frozen sources and inputs. Raises CheckpointCorrupt for a step that has no
    manifest (`info.reason` says why)."""

    def __init__(self, reader: CheckpointReader, info: CheckpointInfo):
        manifest = info.manifest
        if manifest is None:
            raise CheckpointCorrupt(f"{info.url}: {info.reason or 'no manifest'}")
        self.reader = reader
        self.info = info
        self._manifest = manifest
        self._files = manifest.files
        self._derived: dict[Any, Any] = {}
        self._index: ShardIndex | None = None

    def __repr__(self) -> str:
        return f"CheckpointView({self.url!r})"

    # -- identity
    @property
    def url(self) -> str:
        return self.info.url

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def storage_options(self) -> dict[str, Any]:
        """The options the user gave for this checkpoint's store (never the manifest's: those are redacted)."""
        return self.reader.storage_options

    @property
    def time_utc(self) -> str:
        return self.info.time_utc

    @property
    def run(self) -> str | None:
        """The run id that wrote it (None: an older gentrain, or a tool)."""
        return self._manifest.run

    @property
    def timeline(self) -> str | None:
        return self._manifest.timeline

    @property
    def job(self) -> str | None:
        """TORCHELASTIC_RUN_ID of the job that wrote it."""
        return self._manifest.job

    @property
    def owner(self) -> str:
        """Who wrote it, in words (for logs and errors)."""
        return describe_owner(self._manifest)

    @property
    def world_size(self) -> int | None:
        return self._manifest.world_size

    # -- files
    @property
    def file_names(self) -> list[str]:
        return list(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    @property
    def total_bytes(self) -> int:
        return self.info.total_bytes

    @property
    def digest_algorithms(self) -> list[str]:
        """The digest algorithms its files were listed with (`blake3`; `sha256` in older checkpoints)."""
        return sorted({e.algorithm for e in self._files.values()})

    @property
    def holds_training_state(self) -> bool:
        """It has trainer.json (a training checkpoint), not only weights (a consolidated copy)."""
        return TRAINER_JSON in self._files

    @property
    def is_sharded(self) -> bool:
        return SHARD_INDEX in self._files

    def read_json(self, name: str) -> Any:
        return self.reader.read_json(self.info, name)

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return self.reader.read_tensors(self.info, name)

    # -- what the run recorded
    @property
    def config_tree(self) -> dict[str, Any] | None:
        """The run's config as the manifest holds it (a copy; None if it holds no mapping). Parse it with
        `trainer.runs.config_of`, which keeps the result on the view."""
        tree = self._manifest.config
        return copy.deepcopy(tree) if isinstance(tree, dict) else None

    def derived(self, key: Any, build: Callable[[], T]) -> T:
        """`build()`, computed once per view and `key` (the parsed config, a model's shapes)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @property
    def frozen_records(self) -> dict[str, FrozenRecord]:
        """{part: record} of the frozen parts the run loaded: the source's url, step, file and digest (copies)."""
        return {name: record.model_copy(deep=True) for name, record in self._manifest.frozen.items()}

    def frozen_record(self, part: str) -> FrozenRecord | None:
        return self.frozen_records.get(part)

    @property
    def inputs(self) -> dict[str, InputRecord]:
        """{name: record} of the other things the run depends on (a text encoder, a pretrained folder):
        URL or source and digest; pinned ones must match on resume and sampling (copies)."""
        return {name: record.model_copy(deep=True) for name, record in self._manifest.inputs.items()}

    @property
    def adapter_only(self) -> dict[str, str]:
        """{part: the `inputs` entry that pins its frozen base} of the parts whose files hold only what trained
        (a LoRA part's adapters, their optimizer state and EMA): a resume, `sample` and `export` rebuild the
        base from that pinned folder and load the adapters over it. Empty for checkpoints of whole parts
        (full fine-tunes, runs from scratch, every checkpoint written before adapter-only ones)."""
        found = (self._manifest.model_extra or {}).get("adapter_only")
        if not isinstance(found, dict):
            return {}
        return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}

    def metadata(self) -> dict[str, Any]:
        """What the run recorded about itself (config, inputs, frozen sources, world size, owner, ...):
        the manifest without the store's own bookkeeping. Not redacted: redact before writing it anywhere."""
        return copy.deepcopy({k: v for k, v in self._manifest.dump().items() if k not in _BOOKKEEPING})

    # -- parts
    @property
    def parts_with_weights(self) -> list[str]:
        return parts_with_weights(self._files)

    def files_of_group(self, group: str) -> list[str]:
        """Every file holding (a slice of) `<part>.<kind>`, in either layout."""
        return group_files(self._files, group)

    def weights_name(self, part: str, use_ema: bool) -> str:
        """The weights of `part`: a file name (`unet.ema.safetensors`) or, sharded, its group (`unet.ema`);
        the online weights when `use_ema` and there are no EMA weights. ConfigError if it has no such part."""
        present = {}
        for kind in ("model", "ema"):
            group = group_name(part, kind)
            shards = self.files_of_group(group)
            if shards:
                present[kind] = shards[0] if shards == [whole_file(group)] else group
        if "model" not in present:
            raise ConfigError(
                f"{self.url} has no part {part!r} (its parts: {', '.join(self.parts_with_weights) or 'none'})"
            )
        return present["ema"] if use_ema and "ema" in present else present["model"]

    def file_digest(self, name: str) -> str:
        """The digest of a part's weights as `algorithm:hex`: the manifest's for a single file
        (`unet.ema.safetensors`); for the shards of a sharded checkpoint (`unet.ema`), a blake3 over their
        names and digests. KeyError if it has neither."""
        if name in self._files:
            entry = self._files[name]
            return f"{entry.algorithm}:{entry.hexdigest}"
        parsed = parse_group(name)
        shards = self.files_of_group(parsed.group) if parsed is not None else []
        if not shards:
            raise KeyError(f"{self.url}: manifest has no file or shards {name!r}")
        h = new_digest("blake3")
        for shard in shards:
            entry = self._files[shard]
            h.update(f"{shard} {entry.algorithm}:{entry.hexdigest}\n".encode())
        return f"blake3-shards:{h.hexdigest()}"

    def whole_file_digests(self, parts: Iterable[str], use_ema: bool) -> dict[str, str]:
        """{file: `algorithm:hex`} of the single weights files (EMA or online) of `parts` (a model card's list)."""
        suffix = ".ema.safetensors" if use_ema else ".model.safetensors"
        wanted = set(parts)
        return {
            f: f"{entry.algorithm}:{entry.hexdigest}"
            for f, entry in self._files.items()
            if f.endswith(suffix) and f.removesuffix(suffix) in wanted
        }

    def read_weights(self, name: str) -> dict[str, torch.Tensor]:
        """Whole tensors of one weights file, or assembled from the shards of a sharded checkpoint."""
        if name in self._files:
            return self.reader.read_tensors(self.info, name)
        index = self.shard_index()
        entries = index.group(name)
        targets = {k: torch.empty(e.shape, dtype=torch_dtype(e.dtype)) for k, e in entries.items()}
        return load_group(index, name, targets)

    def part_weights(self, part: str, use_ema: bool) -> dict[str, torch.Tensor]:
        return self.read_weights(self.weights_name(part, use_ema))

    def shard_index(self) -> ShardIndex:
        """Where each tensor lives (shards.json read once, or safetensors headers)."""
        if self._index is None:
            self._index = ShardIndex(self.reader, self.info)
        return self._index

    def saved_shapes(self, part: str, kind: str) -> tuple[str, dict[str, list[int]]] | None:
        """(the file or, sharded, the group, {key: global shape}) of a part's `model`, `ema` or `optimizer`
        tensors, from shards.json or the safetensors header (no tensor data is read); None if it has none."""
        group = group_name(part, kind)
        index = self.shard_index()
        if not index.has(group):
            return None
        shards = self.files_of_group(group)
        what = shards[0] if shards == [whole_file(group)] else group
        return what, {key: list(entry.shape) for key, entry in index.group(group).items()}

    def trainer_state(self) -> TrainerState:
        """trainer.json (parsed and checked), read once; CheckpointCorrupt if the checkpoint has none."""
        return self.derived(TRAINER_JSON, lambda: self.read_json(TRAINER_JSON))

    def part_steps(self) -> dict[str, int] | None:
        """Each part's step count; None for a checkpoint with weights only (a consolidated copy)."""
        if not self.holds_training_state:
            return None
        return {n: p.step for n, p in self.trainer_state().parts.items()}


def candidate_views(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[bool, Iterator[CheckpointView]]:
    """The checkpoints a command that loads some of a checkpoint's files may use (`sample`, `eval`, `export`):
    read what you load. Nothing is hashed here: each file is hashed once, as the command reads it
    (`CheckpointReader.read_file`), so a sample reads the EMA weights and trainer.json, not the optimizer state
    (about 4x the weights under Adam) and not the weights twice. `checkpoints verify` and a resume keep the full
    check (`resolve_checkpoint`, `valid_candidates(deep=True)`).

    A step dir: (False, that checkpoint), or CheckpointCorrupt saying why it is not committed. A root: (True,
    its committed checkpoints, newest first): the caller goes on to the next when a file it reads fails its
    digest or structure, as a resume falls back past an invalid checkpoint.
    """
    url = url.rstrip("/")
    base = posixpath.basename(url)
    step = parse_step_dir(base)
    if step is None:
        reader = CheckpointReader(url, storage_options)
        return True, (reader.view(info) for info in reader.valid_candidates(deep=False))
    reader = CheckpointReader(url[: -len(base) - 1] or ".", storage_options)
    info = reader.check(step)
    if not info.valid:
        raise CheckpointCorrupt(info.reason)
    return False, iter([reader.view(info)])


def check_pinned_inputs(
    recorded: Mapping[str, InputRecord | Mapping[str, Any]], current: Mapping[str, InputRecord], where: str
) -> None:
    """Refuse (exit 2) when an input the run pinned (`pin`, e.g. its text encoder) now has another digest: the
    model was trained on the old one's outputs and would silently get different conditions. `recorded` may be a
    memory-tier piece's (its JSON, checked against the manifest's schema when the piece was read)."""
    recorded = {name: InputRecord.model_validate(r) for name, r in recorded.items()}
    for name, now in current.items():
        was = recorded.get(name)
        if not now.pin or was is None or was.digest == now.digest:
            continue
        if isinstance(was.files, Mapping) and isinstance(now.files, Mapping):
            # A folder pinned file by file (a released pipeline's): name the files that changed or are gone.
            before, after = was.files, now.files
            changed = sorted(f for f in before if after.get(f) != before[f]) + sorted(set(after) - set(before))
            raise ConfigError(
                f"{name}: {where} was trained with {was.url} ({was.digest}), but these of its files "
                f"changed or are gone: {', '.join(changed[:8])}. Its outputs would differ from the ones the model "
                "learned. Restore the folder as it was, or start a new run (a new checkpoint.url)."
            )
        raise ConfigError(
            f"{name}: {where} was trained with {was.name} ({was.digest}), but {now.name} now gives {now.digest}. "
            "Its outputs would differ from the ones the model learned. Use the same weights again, or start a new "
            "run (a new checkpoint.url)."
        )
    for name, now in current.items():
        was = recorded.get(name)
        if not now.pin and was is not None and was.digest != now.digest:
            log.info(
                "%s: %s changed since %s started (%s -> %s); the checkpoint's weights are used",
                name,
                now.url,
                where,
                was.digest,
                now.digest,
            )
