"""What a valid checkpoint is, decided in one place: manifest schema, payload structure, JSON state schemas.

Everything in a checkpoint root can be written by anyone with write access to the bucket, so every
byte read from it is parsed against a schema here before anything else looks at it:

- `parse_manifest`: the manifest's fields and types (file names that stay inside the step dir, sizes,
  one digest per file of a known algorithm, frozen-part and input records).
- `parse_safetensors_header`: a safetensors header bounded by the file's size, known dtypes, shapes and
  data offsets that tile the data exactly, read on a stream; then read again by the safetensors library
  itself and made on torch's meta device, so a header passes only if the loaders accept it.
- `parse_trainer_json`, `parse_rank_json`, `parse_shard_index`: the JSON state files; `check_rank_tensors`:
  a rank's RNG tensors. RNG states are applied to scratch generators, so what passes can be set.
- `check_payload`: one file, by its role in the layout, through its digest and its structure.

The store (`CheckpointStore.check` cheaply, `CheckpointStore.verify` fully), resume, sampling and the
save path's "already committed?" check all call these, so they agree on what is valid. Every failure is
a `CheckpointCorrupt` whose message says what was wrong; nothing here raises anything else for bad
bytes.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import types
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_serializer,
    model_validator,
)

from trainer.checkpoint.format import SAFETENSORS_DTYPES, library_header
from trainer.checkpoint.layout import MANIFEST
from trainer.ema import EMAModel
from trainer.errors import CheckpointCorrupt
from trainer.randomness import CURRENT_STREAM, check_rng_state

FORMAT_VERSION = 2  # 2: blake3 digests, sharded layout; 1 (sha256, one writer) still loads
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit on a header
MAX_JSON_BYTES = 256 << 20  # a trainer.json / shards.json larger than this is not one gentrain wrote
# A payload file name: one path component, no dot files, nothing a join could turn into another path.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")
_HEX64 = r"^[0-9a-f]{64}$"
OWNER_ID = r"^[0-9a-f]{8,64}$"  # a run or timeline id (trainer.checkpoint.store.Timeline)

NonNegInt = Annotated[StrictInt, Field(ge=0, lt=1 << 63)]  # counters and sizes: int64 at most


class _Open(BaseModel):
    """Known fields are typed; fields a newer gentrain adds are kept (forward compatible)."""

    model_config = ConfigDict(extra="allow")


class _Ordered(_Open):
    """A document written in the key order it was made or parsed in, with only the keys it was given: the JSON
    the format always had (its writers built dicts; a model's own order is its fields', then its extras)."""

    _keys: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: Any) -> Any:
        made = handler(data)
        if isinstance(data, Mapping):
            made._keys = list(data)
        return made

    @model_serializer(mode="wrap")
    def _in_order(self, handler: Any) -> dict[str, Any]:
        doc = handler(self)
        return {k: doc[k] for k in [*self._keys, *(k for k in doc if k not in self._keys)] if k in doc}

    def dump(self) -> dict[str, Any]:
        """The document as made or parsed: its keys in their order, nothing added (no defaults for absent ones)."""
        return self.model_dump(exclude_unset=True)


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: NonNegInt
    blake3: Annotated[StrictStr, Field(pattern=_HEX64)] | None = None
    sha256: Annotated[StrictStr, Field(pattern=_HEX64)] | None = None

    @model_validator(mode="after")
    def _one_digest(self) -> FileEntry:
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("needs exactly one digest (blake3 or sha256)")
        return self

    @property
    def algorithm(self) -> str:
        """`blake3`, or `sha256` in a checkpoint written before blake3."""
        return "blake3" if self.blake3 is not None else "sha256"

    @property
    def hexdigest(self) -> str:
        return self.blake3 if self.blake3 is not None else self.sha256  # type: ignore[return-value]


class FrozenRecord(_Open):
    """Where a frozen part's weights came from (a source run's step and file, or a diffusers folder's
    `"format": "diffusers"`): pinned in trainer.json and the manifest, passed as this model from the view or
    the loader (`trainer.runs.load_frozen`) to the engine, and dumped with `model_dump()` (the same keys)."""

    url: StrictStr
    step: NonNegInt
    file: StrictStr
    digest: StrictStr


class PinnedFile(_Open):
    """One file of a pinned pipeline folder (`InputRecord.files`): its blake3 and size, as hashed when read."""

    blake3: Annotated[StrictStr, Field(pattern=_HEX64)]
    bytes: NonNegInt


class InputRecord(_Ordered):
    """One of a run's `inputs` in manifest.json: what else the run depends on (`Task.inputs`), by kind:

    - a pretrained folder (`<part>.pretrained`, `trainer.models.finetune.read_folder`): `url`, `digest`, `files`
      (the names hashed);
    - a released pipeline folder (`pipeline`, `trainer.models.pipelines.inspect_pipeline`): `url`, `family`,
      `files` ({path: PinnedFile}), `digest`;
    - an encoder (`text_encoder`, `image_encoder`): `source`, `digest`.

    `pin` (absent: false) says a resume or a sample must find the same digest (`check_pinned_inputs`). Written in
    the key order it was made or parsed in (the JSON the format always had), with only the keys it was given."""

    url: StrictStr | None = None
    source: StrictStr | None = None
    family: StrictStr | None = None
    files: list[StrictStr] | dict[StrictStr, PinnedFile] | None = None
    digest: StrictStr | None = None
    pin: StrictBool = False

    @property
    def name(self) -> str | None:
        """What it is read from: a folder's URL, an encoder's source."""
        return self.source or self.url

    def pinned(self, pin: bool = True) -> InputRecord:
        """This record with `pin` (appended last, as the tasks have always written it)."""
        return self.model_copy(update={"pin": pin}) if pin else self.model_copy()


class Manifest(_Ordered):
    """manifest.json, the commit point of a step dir: `parse_manifest` makes it, `CheckpointInfo.manifest` carries
    it and `trainer.checkpoint.view.CheckpointView` interprets it. Fields a run records beyond these (`parallel`,
    `adapter_only`, versions) are kept as extras; the store writes the JSON in its own key order (`commit`)."""

    format_version: Annotated[StrictInt, Field(ge=1, le=FORMAT_VERSION)] = 1
    step: NonNegInt
    files: dict[StrictStr, FileEntry]
    world_size: Annotated[StrictInt, Field(ge=1)] | None = None
    time_utc: StrictStr | None = None
    digest: StrictStr | None = None
    task: StrictStr | None = None
    config: dict[StrictStr, Any] | None = None  # a training checkpoint's is required (see `_cross_check`)
    frozen: dict[StrictStr, FrozenRecord] = {}
    inputs: dict[StrictStr, InputRecord] = {}
    # Who wrote it (absent before gentrain recorded it: such a checkpoint belongs to no timeline of now).
    run: Annotated[StrictStr, Field(pattern=OWNER_ID)] | None = None
    timeline: Annotated[StrictStr, Field(pattern=OWNER_ID)] | None = None
    job: Annotated[StrictStr, Field(max_length=256)] | None = None
    # `dump()` keeps the document's key order: what a copy of its metadata writes (`CheckpointView.metadata`,
    # `checkpoints consolidate`) and the store's commit (`manifest_json`) keep the order the format always had.


class PieceDoc(_Open):
    """A memory-tier piece (trainer.checkpoint.memory): the files one rank contributes to a step. `parse_piece`
    makes it from a file, the tier builds one to write it (`dump`); the tier, its resume and `checkpoints list`
    read it by attribute (`files`, `sharded`), and owner 0's `manifest_fields` (its `meta`, checked as a
    manifest's) say whose run it is and what it pinned."""

    format_version: Annotated[StrictInt, Field(ge=1, le=FORMAT_VERSION)]
    step: NonNegInt
    owner: NonNegInt
    world_size: Annotated[StrictInt, Field(ge=1)]
    sharded: StrictBool
    files: dict[StrictStr, FileEntry]
    index: dict[StrictStr, dict[StrictStr, IndexedTensor]] = {}  # this owner's part of shards.json (sharded)
    meta: dict[StrictStr, Any] | None = None  # owner 0: what the manifest says about the run
    _manifest: Manifest | None = PrivateAttr(default=None)

    @property
    def manifest_fields(self) -> Manifest | None:
        """Owner 0's `meta` as the manifest its commit writes (no files yet); None for the other owners."""
        return self._manifest

    def dump(self) -> dict[str, Any]:
        """The piece file's JSON (`trainer.checkpoint.memory` writes it, `parse_piece` reads it back)."""
        return {**self.model_dump(), "files": self.entries(), "index": self.index_entries()}

    def entries(self) -> dict[str, dict[str, Any]]:
        """The manifest entries of its files (as `CheckpointStore.write_files` made them)."""
        return {name: entry.model_dump(exclude_none=True) for name, entry in self.files.items()}

    def index_entries(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Its part of shards.json (`trainer.checkpoint.sharded.merge_indexes` takes them)."""
        return {g: {k: t.model_dump() for k, t in tensors.items()} for g, tensors in self.index.items()}


class ProgressState(_Ordered):
    step: NonNegInt
    cursor: NonNegInt
    skipped_samples: NonNegInt = 0
    skipped_files: list[StrictStr] = []
    world_size: Annotated[StrictInt, Field(ge=1)] | None = None
    seed: StrictInt | None = None
    order: dict[StrictStr, Any] | None = None
    time_unix: StrictFloat | StrictInt | None = None
    goodput: Any = None  # the time accounting (trainer.engine.goodput), read by `gentrain goodput`
    rng_stream: Annotated[StrictInt, Field(ge=1, le=CURRENT_STREAM)] | None = None  # absent: stream 1


class PartState(_Ordered):
    step: NonNegInt
    optimizer: dict[StrictStr, Any]
    optimizer_name: StrictStr | None = None  # absent before train.optimizer: adamw
    lr_schedule: dict[StrictStr, Any] | None = None
    scaler: dict[StrictStr, Any] | None = None
    ema: dict[StrictStr, Any] | None = None
    # "trainable": a LoRA part's files hold its adapters only; its frozen base is the pinned pretrained folder
    # (trainer.checkpoint.state). Absent: the whole part.
    weights: Literal["all", "trainable"] | None = None


class TrainerState(_Ordered):
    """trainer.json: `parse_trainer_json` makes it, `CheckpointReader.read_json` hands it out, and resume
    (trainer.checkpoint.state), `verify` and the view read it by attribute (`parts[name].step`). A save builds
    it (`trainer.checkpoint.state.snapshot_files`) and writes `trainer_json(state)`: the keys in the order they
    were given (a LoRA part's `weights` first), the JSON the format always had."""

    progress: ProgressState
    parts: dict[StrictStr, PartState]
    frozen: dict[StrictStr, FrozenRecord] = {}


_MT_WORDS = 624  # the Mersenne Twister state Python's `random` and numpy's legacy RandomState keep


class RngValues(BaseModel):
    """Python's `random.getstate()` and numpy's `get_state()`, as `trainer.randomness.rng_state` stores them."""

    model_config = ConfigDict(extra="forbid")
    python: tuple[
        StrictInt,
        Annotated[
            list[Annotated[StrictInt, Field(ge=0, lt=1 << 32)]],
            Field(min_length=_MT_WORDS + 1, max_length=_MT_WORDS + 1),
        ],
        StrictFloat | None,
    ]
    numpy: tuple[
        StrictStr,
        Annotated[
            list[Annotated[StrictInt, Field(ge=0, lt=1 << 32)]], Field(min_length=_MT_WORDS, max_length=_MT_WORDS)
        ],
        Annotated[StrictInt, Field(ge=0, le=_MT_WORDS)],
        StrictInt,
        StrictFloat | StrictInt,
    ]


class RankState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rng: RngValues


class Chunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: StrictStr
    offsets: list[NonNegInt]
    sizes: list[NonNegInt]


class IndexedTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: StrictStr
    shape: list[NonNegInt]
    chunks: list[Chunk]


class ShardIndexDoc(_Open):
    """shards.json of a sharded step: `parse_shard_index` makes it, `trainer.checkpoint.sharded.ShardIndex` reads
    its `tensors` ({group: {key: IndexedTensor}}) by attribute, as it makes the same entries of a whole file."""

    version: Annotated[StrictInt, Field(ge=1, le=1)]
    world_size: Annotated[StrictInt, Field(ge=1)]
    tensors: dict[StrictStr, dict[StrictStr, IndexedTensor]]


PieceDoc.model_rebuild()  # its index holds IndexedTensor entries, defined after it


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "top level"
    value = repr(err.get("input"))
    if len(value) > 60:
        value = value[:57] + "..."
    return f"{where}: {err['msg']} (found {value})"


def parse_json(raw: bytes, what: str) -> Any:
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointCorrupt(f"{what} is {len(raw)} bytes, more than any gentrain writes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointCorrupt(f"{what} is not JSON ({type(e).__name__}: {str(e)[:120]})") from None


def _model(schema: type[BaseModel], doc: Any, what: str) -> BaseModel:
    try:
        return schema.model_validate(doc)
    except ValidationError as e:
        raise CheckpointCorrupt(f"{what} does not match its schema: {_first_error(e)}") from None
    except RecursionError:
        raise CheckpointCorrupt(f"{what} is nested too deeply") from None


# ------------------------------------------------------------------ manifest


def parse_manifest(raw: bytes, step: int) -> Manifest:
    """The manifest, checked against its schema and the step dir it is in; CheckpointCorrupt if not."""
    doc = parse_json(raw, MANIFEST)
    if not isinstance(doc, dict):
        raise CheckpointCorrupt(f"{MANIFEST} holds a {type(doc).__name__}, not an object")
    manifest = _model(Manifest, doc, MANIFEST)
    assert isinstance(manifest, Manifest)
    if manifest.step != step:
        raise CheckpointCorrupt(f"{MANIFEST} says step {manifest.step}, but it is in the dir of step {step}")
    for name in manifest.files:
        if not FILE_NAME.match(name) or name == MANIFEST or ".." in name:
            raise CheckpointCorrupt(f"{MANIFEST} lists a file named {name!r}, which is not a payload file name")
    return manifest


def manifest_json(doc: Mapping[str, Any]) -> bytes:
    """The bytes `CheckpointStore.commit` writes for `doc`: made a `Manifest` (CheckpointCorrupt if it is not
    one, before anything is committed) and dumped in `doc`'s own key order, the JSON the format always had."""
    manifest = _model(Manifest, dict(doc), MANIFEST)
    assert isinstance(manifest, Manifest)
    return json.dumps(manifest.dump(), indent=1).encode()


def parse_piece(raw: bytes, step: int, owner: int) -> PieceDoc:
    """A memory-tier piece file, checked against its schema, its step dir and its name; CheckpointCorrupt if not."""
    doc = parse_json(raw, f"piece of rank {owner}")
    if not isinstance(doc, dict):
        raise CheckpointCorrupt(f"piece of rank {owner} holds a {type(doc).__name__}, not an object")
    piece = _model(PieceDoc, doc, f"piece of rank {owner}")
    assert isinstance(piece, PieceDoc)
    if piece.step != step or piece.owner != owner or owner >= piece.world_size:
        raise CheckpointCorrupt(
            f"piece of rank {owner} in the dir of step {step} says rank {piece.owner} of {piece.world_size}, "
            f"step {piece.step}"
        )
    if (owner == 0) != (piece.meta is not None):
        raise CheckpointCorrupt(f"piece of rank {owner}: only rank 0's piece carries the run's manifest fields")
    if piece.meta is not None:  # what the manifest will say: its fields and types, as in a manifest
        fields = {**piece.meta, "step": step, "files": {}}
        manifest = _model(Manifest, fields, f"piece of rank {owner}: its manifest fields")
        assert isinstance(manifest, Manifest)
        piece._manifest = manifest
    for name in piece.files:
        if not FILE_NAME.match(name) or name == MANIFEST or ".." in name or name.startswith("piece-"):
            raise CheckpointCorrupt(f"piece of rank {owner} lists a file named {name!r}, not a payload file name")
    return piece


# ------------------------------------------------------------------ safetensors


def parse_safetensors_header(read: Callable[[int, int], bytes], size: int, what: str) -> tuple[dict[str, Any], int]:
    """(tensors' header entries, offset where data starts) of a safetensors file of `size` bytes.

    `read(start, length)` returns bytes of the file. Checks what the safetensors library checks
    before it trusts a header: its length fits the file, it is a JSON object of known dtypes and
    non-negative shapes, and the data offsets tile the data section exactly, in order.
    """
    if size < 8:
        raise CheckpointCorrupt(f"{what}: {size} bytes, too short for a safetensors file")
    n = int.from_bytes(read(0, 8), "little")
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointCorrupt(f"{what}: safetensors header length {n} does not fit the file ({size} bytes)")
    raw = read(8, n)
    try:
        # UTF-8 only, as the library reads it (Python's json would also take UTF-16 and UTF-32 bytes).
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointCorrupt(f"{what}: unreadable safetensors header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointCorrupt(f"{what}: safetensors header is a {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise CheckpointCorrupt(f"{what}: safetensors __metadata__ must map strings to strings")
    spans = []
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointCorrupt(f"{what}: tensor {key!r} has a malformed header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise CheckpointCorrupt(f"{what}: tensor {key!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 63 for d in shape):
            raise CheckpointCorrupt(f"{what}: tensor {key!r} has shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointCorrupt(f"{what}: tensor {key!r} has data_offsets {offsets!r}")
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes or offsets[0] < 0:
            raise CheckpointCorrupt(f"{what}: tensor {key!r} spans {offsets}, but {dtype}{shape} is {nbytes} bytes")
        spans.append((offsets[0], offsets[1], key))
    pos = 0
    for start, stop, key in sorted(spans):
        if start != pos:
            raise CheckpointCorrupt(f"{what}: tensor {key!r} starts at {start}, expected {pos} (gap or overlap)")
        pos = stop
    if 8 + n + pos != size:
        raise CheckpointCorrupt(f"{what}: its tensors hold {pos} bytes, the file has {size - 8 - n} after the header")
    _check_loadable(header, n.to_bytes(8, "little") + raw, size, what)
    return header, 8 + n


def _check_loadable(header: Mapping[str, Any], head: bytes, size: int, what: str) -> None:
    """The safetensors library reads the same tensors from the header, and torch can make each of them.

    The checks above are gentrain's reading of the format; the library that loads the file parses the
    header again its own way (see `trainer.checkpoint.format.library_header`), and torch sizes are signed
    64-bit where the format's are unsigned. A header passes only if both accept it as gentrain read it,
    so what verify accepts loads (tests/test_checkpoint_fuzz.py holds this on fuzzed headers)."""
    try:
        seen = library_header(head, size)
    except ValueError as e:
        raise CheckpointCorrupt(f"{what}: the safetensors library refuses its header ({e})") from None
    ours = {key: (entry["dtype"], tuple(entry["shape"])) for key, entry in header.items()}
    theirs = {key: (dtype, tuple(shape)) for key, (dtype, shape) in seen.items()}
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=repr)[:2]
        raise CheckpointCorrupt(f"{what}: the safetensors library reads its header otherwise ({differ})"[:300])
    for key, (dtype, shape) in ours.items():
        try:
            torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype], device="meta")
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            why = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise CheckpointCorrupt(f"{what}: tensor {key!r} of shape {list(shape)} cannot be made ({why})") from None


# ------------------------------------------------------------------ attempts.json


MAX_ATTEMPTS_BYTES = 64 << 10  # a record gentrain writes is under 2 KB; more is not read


class CrashRecord(_Open):
    """The crash of the last attempt (trainer.engine.attempts)."""

    signature: Annotated[StrictStr, Field(max_length=1024)]
    error: Annotated[StrictStr, Field(max_length=4096)]
    step: NonNegInt
    resume_step: NonNegInt | None  # where the next attempt is expected to resume from (None: a fresh start)
    run: Annotated[StrictStr, Field(pattern=OWNER_ID)] | None = None
    count: Annotated[StrictInt, Field(ge=1, le=1 << 20)]
    time_utc: StrictStr | None = None


class AttemptsDoc(_Open):
    """attempts.json (trainer.engine.attempts): `parse_attempts` makes it, the next attempt reads its `crash`."""

    format_version: Annotated[StrictInt, Field(ge=1, le=1)]
    attempt: dict[StrictStr, Any]
    crash: CrashRecord | None = None


def parse_attempts(raw: bytes) -> AttemptsDoc:
    """attempts.json, checked against its schema; CheckpointCorrupt if it is not one gentrain wrote."""
    if len(raw) > MAX_ATTEMPTS_BYTES:
        raise CheckpointCorrupt(f"attempts.json is {len(raw)} bytes, more than gentrain writes")
    doc = parse_json(raw, "attempts.json")
    if not isinstance(doc, dict):
        raise CheckpointCorrupt(f"attempts.json holds a {type(doc).__name__}, not an object")
    record = _model(AttemptsDoc, doc, "attempts.json")
    assert isinstance(record, AttemptsDoc)
    return record


# ------------------------------------------------------------------ JSON state


def parse_trainer_json(raw: bytes, step: int | None = None) -> TrainerState:
    """trainer.json (progress, per-part state, frozen sources), checked; CheckpointCorrupt if malformed."""
    doc = parse_json(raw, "trainer.json")
    if not isinstance(doc, dict):
        raise CheckpointCorrupt(f"trainer.json holds a {type(doc).__name__}, not an object")
    state = _model(TrainerState, doc, "trainer.json")
    assert isinstance(state, TrainerState)
    if step is not None and doc["progress"]["step"] != step:
        raise CheckpointCorrupt(f"trainer.json says step {doc['progress']['step']}, the manifest {step}")
    for name, part in doc["parts"].items():
        _check_skeleton(part["optimizer"], f"trainer.json parts.{name}.optimizer")
        check_param_groups(part["optimizer"], f"trainer.json parts.{name}.optimizer")
        _check_settings_load(part, f"trainer.json parts.{name}")
    return state


def trainer_json(
    progress: Mapping[str, Any], parts: Mapping[str, PartState], frozen: Mapping[str, FrozenRecord]
) -> bytes:
    """The bytes a save writes for trainer.json: a `TrainerState` of the progress (its `state_dict`, in its
    order), the parts' states and the frozen records (CheckpointCorrupt naming the field if it is not one,
    before anything is written), dumped in the key order it was given."""
    doc = {"progress": dict(progress), "parts": dict(parts), "frozen": dict(frozen)}
    state = _model(TrainerState, doc, "trainer.json")
    assert isinstance(state, TrainerState)
    return json.dumps(state.dump(), indent=1).encode()


# The settings a saved group must have: torch's Adam/AdamW `__setstate__` fills in the others (maximize,
# foreach, fused, ...) when a state from an older torch lacks them, but its step reads these unconditionally.
_REQUIRED_SETTINGS = ("lr", "betas", "eps", "weight_decay")
_IMPLEMENTATION = ("fused", "foreach")  # how this process steps: replaced by the live part's at load
_MAX_GROUPS = 4096


@functools.cache
def _adamw_settings() -> dict[str, Any]:
    """A parameter group of a scratch AdamW (torch's constructor defaults): the type of each setting."""
    group = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


@functools.cache
def _adamw_arguments() -> frozenset[str]:
    """The settings AdamW's constructor takes (its groups also hold ones it sets itself)."""
    return frozenset(inspect.signature(torch.optim.AdamW.__init__).parameters) - {"self", "params"}


def check_param_groups(optimizer: Any, what: str) -> None:
    """A part's saved optimizer settings (`param_groups`) are ones its step can use: every setting a scratch
    AdamW has is of that setting's type (a float may be an int, a tensor reference or nothing else; betas a
    list of two), the ones its step reads are there, and the hyperparameters pass AdamW's own constructor
    (a learning rate, betas, eps and weight decay in range, finite). Each group's `params` are distinct
    parameter indices.

    Why here: torch's `Optimizer.load_state_dict` checks only how many groups and parameters there are and
    takes every other value as it is, so `lr: "high"` or `betas: [0.9]` loaded, then crashed the first step
    of every restart (exit 1, retried forever) while verify called the checkpoint valid. Now verify refuses
    it and a resume falls back past it, like any checkpoint its loaders would refuse.

    adamw8bit (torchao's AdamW8bit) keeps a subset of AdamW's settings with the same types and ranges, its
    lr a tensor (a {"__tensor__": key} reference here): it is checked against AdamW's, so verify needs no
    torchao. Settings this torch does not know (a newer torch's) are left alone: its step never reads them.
    How many groups and parameters the model needs is the fit check's (`trainer.runs.fit_problems`) and,
    at resume, `trainer.checkpoint.state.check_fits`'."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or len(groups) > _MAX_GROUPS:
        raise CheckpointCorrupt(f"{what}.param_groups is not a list of parameter groups")
    defaults = _adamw_settings()
    for i, group in enumerate(groups):
        where = f"{what}.param_groups[{i}]"
        if not isinstance(group, dict):
            raise CheckpointCorrupt(f"{where} is a {type(group).__name__}, not an object")
        params = group.get("params")
        if (
            not isinstance(params, list)
            or not all(type(p) is int and 0 <= p < 1 << 63 for p in params)
            or len(set(params)) != len(params)
        ):
            raise CheckpointCorrupt(f"{where}.params is not a list of distinct parameter indices")
        missing = [k for k in _REQUIRED_SETTINGS if k not in group]
        if missing:
            raise CheckpointCorrupt(f"{where} has no {', '.join(missing)}: its optimizer step reads them")
        for key, value in group.items():
            if key in defaults or key == "initial_lr":
                problem = _setting_problem(value, defaults.get(key, 0.0), key in _IMPLEMENTATION)
                if problem:
                    raise CheckpointCorrupt(f"{where}.{key} is {_short(value)}: {problem}")
        if group.get("differentiable"):  # gentrain never trains with it, and a fused step refuses it
            raise CheckpointCorrupt(f"{where}.differentiable is true: the fused AdamW step refuses it")
        state = optimizer.get("state") if isinstance(optimizer.get("state"), dict) else {}
        if group.get("amsgrad"):  # its step reads a running maximum every started parameter then has
            started = [state[k] for p in params if isinstance(state.get(k := f"__int__{p}"), dict)]
            if any("max_exp_avg_sq" not in s for s in started):
                raise CheckpointCorrupt(f"{where}.amsgrad is true, but its parameters' state has no max_exp_avg_sq")
        trial = {k: v for k, v in group.items() if k in _adamw_arguments() and k not in _IMPLEMENTATION}
        trial = {k: (defaults[k] if _is_tensor_ref(v) else v) for k, v in trial.items()}
        if isinstance(trial.get("betas"), list):
            trial["betas"] = tuple(
                defaults["betas"][j] if _is_tensor_ref(b) else b for j, b in enumerate(trial["betas"])
            )
        try:
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **trial)
        except (ValueError, TypeError, RuntimeError) as e:
            raise CheckpointCorrupt(f"{where}: AdamW refuses these settings ({type(e).__name__}: {e})"[:300]) from None


def _is_tensor_ref(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"__tensor__"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _setting_problem(value: Any, want: Any, implementation: bool) -> str | None:
    """Why `value` cannot stand for an optimizer setting whose default is `want` (None: it can)."""
    if implementation or want is None:
        return None if value is None or type(value) is bool else "expected true, false or null"
    if type(want) is bool:
        return None if type(value) is bool else "expected true or false"
    if isinstance(want, float | int):
        if _is_tensor_ref(value):
            return None
        if type(value) not in (int, float):
            return "expected a number"
        return None if math.isfinite(value) else "expected a finite number"
    if isinstance(want, tuple | list):
        if not isinstance(value, list) or len(value) != len(want):
            return f"expected a list of {len(want)} numbers"
        problems = [_setting_problem(v, w, False) for v, w in zip(value, want, strict=True)]
        return next((f"expected a list of {len(want)} numbers" for p in problems if p), None)
    return None


def _check_settings_load(part: Mapping[str, Any], what: str) -> None:
    """A part's schedule, loss scaler and EMA settings load: each goes through the `load_state_dict` of a
    scratch object of the kind gentrain builds (torch's LambdaLR and GradScaler, diffusers' EMAModel), so
    a value their loaders refuse (an EMA decay of 5, a scaler without its scale, a schedule without its
    lambdas) fails here, not half-way through a resume. Whether they fit the live part is checked at
    resume (trainer.checkpoint.state)."""
    trials = []
    if part.get("lr_schedule") is not None:
        trials.append(("lr_schedule", lambda: _load_schedule(part["lr_schedule"])))
    if part.get("scaler"):
        trials.append(("scaler", lambda: torch.amp.GradScaler("cpu").load_state_dict(dict(part["scaler"]))))
    if part.get("ema"):
        meta = {**part["ema"], "shadow_params": [torch.zeros(1)]}
        trials.append(("ema", lambda: EMAModel([torch.nn.Parameter(torch.zeros(1))]).load_state_dict(meta)))
    for name, trial in trials:
        try:
            trial()
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise CheckpointCorrupt(f"{what}.{name} cannot be loaded ({type(e).__name__}: {e})"[:300]) from None


def _load_schedule(saved: Mapping[str, Any]) -> None:
    scratch = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), _one)
    unknown = sorted(set(saved) - set(scratch.state_dict()))
    if unknown:
        raise KeyError(f"unknown entries {unknown[:3]}")
    lambdas = saved.get("lr_lambdas")
    if isinstance(lambdas, list) and len(lambdas) <= 4096:  # stand-ins whose __dict__ a saved state may update
        scratch.lr_lambdas = [types.SimpleNamespace() for _ in lambdas]
    scratch.load_state_dict(dict(saved))


def _one(step: int) -> float:
    return 1.0


def _check_skeleton(tree: Any, what: str, depth: int = 0) -> None:
    """An optimizer skeleton: JSON values and {"__tensor__": key} references, bounded in depth."""
    if depth > 32:
        raise CheckpointCorrupt(f"{what} is nested too deeply")
    if isinstance(tree, dict):
        if "__tensor__" in tree and (set(tree) != {"__tensor__"} or not isinstance(tree["__tensor__"], str)):
            raise CheckpointCorrupt(f"{what}: malformed tensor reference {tree!r}"[:200])
        for k, v in tree.items():
            if k.startswith("__int__") and not k[len("__int__") :].lstrip("-").isdigit():
                raise CheckpointCorrupt(f"{what}: malformed integer key {k!r}")
            _check_skeleton(v, what, depth + 1)
    elif isinstance(tree, list):
        for v in tree:
            _check_skeleton(v, what, depth + 1)


def tensor_refs(tree: Any) -> set[str]:
    """Every tensor key an optimizer skeleton refers to."""
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return {tree["__tensor__"]}
        return set().union(*(tensor_refs(v) for v in tree.values())) if tree else set()
    if isinstance(tree, list):
        return set().union(*(tensor_refs(v) for v in tree)) if tree else set()
    return set()


def parse_rank_json(raw: bytes) -> dict[str, Any]:
    """A rank's RNG values (Python's `random`, numpy), checked against their schema and by applying them to
    scratch generators: the values a resume would refuse to set are refused here."""
    doc = parse_json(raw, "rank state")
    _model(RankState, doc, "rank state")
    try:
        check_rng_state(None, doc["rng"])
    except ValueError as e:
        raise CheckpointCorrupt(f"rank state: its RNG state cannot be set ({e})") from None
    return doc


def check_rank_tensors(tensors: Mapping[str, Any], what: str) -> None:
    """A rank's RNG tensors (`rank-NNNNN.safetensors`): a torch CPU state (a uint8 vector named torch_cpu)
    that a scratch generator accepts, and a CUDA one where this process has CUDA."""
    cpu = tensors.get("torch_cpu")
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.ndim != 1:
        raise CheckpointCorrupt(f"{what}: no CPU RNG state (a uint8 vector named torch_cpu)")
    cuda = tensors.get("torch_cuda")
    if cuda is not None and (cuda.dtype != torch.uint8 or cuda.ndim != 1):
        raise CheckpointCorrupt(f"{what}: its CUDA RNG state is not a uint8 vector")
    try:
        check_rng_state(tensors, None)
    except ValueError as e:
        raise CheckpointCorrupt(f"{what}: its RNG state cannot be set ({e})") from None


def parse_shard_index(raw: bytes, files: Mapping[str, Any]) -> ShardIndexDoc:
    """shards.json: every chunk inside its tensor and in a file the manifest lists."""
    doc = parse_json(raw, "shards.json")
    index = _model(ShardIndexDoc, doc, "shards.json")
    assert isinstance(index, ShardIndexDoc)
    for group, tensors in index.tensors.items():
        for key, t in tensors.items():
            if t.dtype not in SAFETENSORS_DTYPES:
                raise CheckpointCorrupt(f"shards.json: {group}:{key} has unknown dtype {t.dtype!r}")
            for c in t.chunks:
                if c.file not in files:
                    raise CheckpointCorrupt(f"shards.json: {group}:{key} points to {c.file!r}, not in the manifest")
                if (
                    len(c.offsets) != len(t.shape)
                    or len(c.sizes) != len(t.shape)
                    or any(o + s > d for o, s, d in zip(c.offsets, c.sizes, t.shape, strict=True))
                ):
                    raise CheckpointCorrupt(f"shards.json: a chunk of {group}:{key} lies outside shape {t.shape}")
    return index
