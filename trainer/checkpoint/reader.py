"""CheckpointReader: discovery, verification and reads of the checkpoints under one fsspec root.

Layout (docs/contract.md, "Checkpoint layout"):

    <root>/step-000001200/manifest.json   written LAST: the commit point
    <root>/step-000001200/<payload files> safetensors for tensors, JSON for the rest
    <root>/LATEST                          hint: name of the newest committed step dir

A checkpoint is *committed* when its step dir is a real dir (not a link), its
manifest parses against its schema and every file it lists exists with the
listed size (`check`, no hashing); it is *valid* when, on top of that, every
file matches its digest (blake3 for new checkpoints, sha256 in older ones)
and its structure (safetensors headers, JSON state schemas): `verify`, with
the rules in `trainer.checkpoint.validity`. Discovery, `verify`, resume,
sampling, retention and the save path's "already committed?" check all use
these two, so they agree. Nothing here unpickles: safetensors and JSON only,
and nothing in a root is trusted: a stray file, a link or a malformed entry is
one invalid candidate, never an error of the whole root.

This is the reading side of the store: it never writes or deletes, so sampling, export, `verify` and a
frozen part's source run get a reader (`resolve_checkpoint` returns a view through one), and only a training
run or a tool that writes a root makes a `CheckpointStore` (store.py: committing; retention.py: pruning).
What a manifest *means* (a part's weights, digests, part steps, the run's config) is read through
`trainer.checkpoint.view.CheckpointView` (`view(info)`), not from the manifest dict.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as safetensors_load

from trainer.checkpoint.format import FiniteScan, NonFiniteTensor, check_finite, new_digest
from trainer.checkpoint.layout import (
    MANIFEST,
    SHARD_INDEX,
    TRAINER_JSON,
    group_name,
    is_rank_json,
    is_rank_tensors,
    is_tensor_file,
    parse_group_file,
    parse_step_dir,
    step_dir_name,
    whole_file,
)
from trainer.checkpoint.validity import (
    MAX_HEADER_BYTES,
    FileEntry,
    Manifest,
    check_rank_tensors,
    parse_json,
    parse_manifest,
    parse_rank_json,
    parse_safetensors_header,
    parse_shard_index,
    parse_trainer_json,
    tensor_refs,
)
from trainer.errors import CheckpointCorrupt
from trainer.storage import filesystem

if TYPE_CHECKING:
    from trainer.checkpoint.view import CheckpointView

log = logging.getLogger(__name__)

LATEST = "LATEST"


@dataclass
class CheckpointInfo:
    """One step dir as discovery found it: committed (`valid`) or why not (`reason`), and its parsed manifest.
    Readers interpret the manifest through `CheckpointView`, never by indexing `manifest`."""

    url: str
    step: int
    valid: bool
    reason: str = ""
    manifest: Manifest | None = None
    fingerprint: str = ""  # blake3 of the manifest's bytes: which commit of this step was checked

    @property
    def name(self) -> str:
        return step_dir_name(self.step)

    @property
    def total_bytes(self) -> int:
        if self.manifest is None:
            return 0
        return sum(entry.bytes for entry in self.manifest.files.values())

    @property
    def time_utc(self) -> str:
        return (self.manifest.time_utc if self.manifest is not None else None) or ""


class CheckpointReader:
    """Discovers, verifies and reads checkpoints under one fsspec root URL; writes nothing."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = filesystem(self.url, self.storage_options)
        self.root = self.root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._verified: set[tuple[int, str]] = set()  # (step, manifest fingerprint) found valid by `verify`
        self._digests_ok: set[tuple[int, str, str]] = set()  # (step, fingerprint, file) whose digest matched

    def view(self, info: CheckpointInfo) -> CheckpointView:
        """`info` read through this reader, its manifest interpreted (trainer.checkpoint.view): the one way
        code outside `trainer.checkpoint` gets a view. CheckpointCorrupt for a step that has no manifest."""
        # view.py builds on this module (a view reads through a reader): imported when a view is made.
        from trainer.checkpoint.view import CheckpointView

        return CheckpointView(self, info)

    # -- paths
    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_for(self, step: int) -> str:
        return f"{self.url}/{step_dir_name(step)}"

    # -- discovery
    def _is_link(self, path: str) -> bool:
        """True for a symbolic link on a local disk (object stores have none)."""
        return self._local and os.path.islink(path)

    def steps(self) -> list[int]:
        """Step numbers of every entry named like a step dir under the root (dirs, files, links; one listing)."""
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for n in names:
            step = parse_step_dir(posixpath.basename(str(n).rstrip("/")))
            if step is not None:
                out.append(step)
        return sorted(set(out))

    def check(self, step: int) -> CheckpointInfo:
        """Committed: a real step dir whose manifest matches its schema and lists files of the listed sizes.

        Never raises for what a root holds: anything odd (a file or a link named like a step dir, an
        unreadable or malformed manifest, a listed file that is a link or a dir) is an invalid candidate
        whose `reason` says why. No hashing: `verify` checks digests and structure.
        """
        d = self._path(step_dir_name(step))
        url = self.url_for(step)
        if self._is_link(d):
            return CheckpointInfo(url, step, False, "is a symbolic link (gentrain never follows links in a root)")
        try:
            raw = self.fs.cat_file(posixpath.join(d, MANIFEST))
        except FileNotFoundError:
            return CheckpointInfo(url, step, False, f"no {MANIFEST} (incomplete or interrupted save)")
        except OSError as e:  # a file named like a step dir (NotADirectoryError), a dir named manifest.json, ...
            return CheckpointInfo(url, step, False, f"{MANIFEST} cannot be read ({type(e).__name__}: {e})")
        try:
            manifest = parse_manifest(raw, step)
        except CheckpointCorrupt as e:
            return CheckpointInfo(url, step, False, str(e))
        fingerprint = new_digest("blake3").update(raw).hexdigest()
        try:
            listing = {posixpath.basename(e["name"]): e for e in self.fs.ls(d, detail=True, refresh=True)}
        except OSError as e:
            return CheckpointInfo(url, step, False, f"cannot list the step dir ({type(e).__name__}: {e})", manifest)
        for name, entry in manifest.files.items():
            found = listing.get(name)
            why = None
            if found is None:
                why = f"{name} is missing"
            elif found.get("islink") or self._is_link(posixpath.join(d, name)):
                why = f"{name} is a symbolic link (gentrain never follows links in a checkpoint)"
            elif found.get("type") != "file":
                why = f"{name} is a {found.get('type')}, not a file"
            elif int(found.get("size") or 0) != entry.bytes:
                why = f"{name} has {found.get('size')} bytes, manifest says {entry.bytes}"
            if why:
                return CheckpointInfo(url, step, False, why, manifest, fingerprint)
        return CheckpointInfo(url, step, True, "", manifest, fingerprint)

    def list(self) -> list[CheckpointInfo]:
        return [self.check(s) for s in self.steps()]

    def latest_hint(self) -> int | None:
        try:
            name = self.fs.cat_file(self._path(LATEST)).decode().strip()
        except (OSError, UnicodeDecodeError):  # absent, a dir, unreadable, binary: only a hint
            return None
        return parse_step_dir(name)

    def valid_candidates(self, deep: bool = False) -> Iterable[CheckpointInfo]:
        """Committed checkpoints (`deep`: valid ones, see `verify`), newest first, each checked lazily.

        LATEST is read first (one GET); one listing of step dir names finds any
        newer step dir the hint does not know of (a crash between manifest and
        LATEST), which is checked before it. Invalid ones are skipped with a
        warning naming why.
        """
        hint = self.latest_hint()
        steps = self.steps()
        order = sorted(steps, reverse=True)
        if hint is not None and hint in steps:
            newer = [s for s in order if s > hint]
            order = newer + [hint] + [s for s in order if s < hint]
        for s in order:
            info = self.check(s)
            problems = [info.reason] if not info.valid else (self.verify(info) if deep else [])
            if not problems:
                yield info
            else:
                log.warning("skipping checkpoint %s: %s", info.url, "; ".join(problems))

    def latest_valid(self, deep: bool = False) -> CheckpointInfo | None:
        """The newest committed checkpoint; with `deep`, the newest that also passes `verify`."""
        return next(iter(self.valid_candidates(deep)), None)

    def is_valid(self, info: CheckpointInfo) -> bool:
        """Committed and every file verified (digest and structure); cached per step and manifest."""
        return info.valid and ((info.step, info.fingerprint) in self._verified or not self.verify(info))

    # -- reading
    def file_path(self, info: CheckpointInfo, name: str) -> str:
        return self._path(info.name, name)

    def manifest_entry(self, info: CheckpointInfo, name: str) -> FileEntry:
        if info.manifest is None:
            raise CheckpointCorrupt(f"{info.url}: {info.reason or 'no manifest'}")
        entry = info.manifest.files.get(name)
        if entry is None:
            raise CheckpointCorrupt(f"{info.url}: manifest lists no file {name!r}")
        return entry

    def check_digest(self, info: CheckpointInfo, name: str, size: int, hexdigest: str, algorithm: str) -> None:
        entry = self.manifest_entry(info, name)
        if size != entry.bytes:
            raise CheckpointCorrupt(f"{info.url}/{name}: {size} bytes, manifest says {entry.bytes}")
        want_algorithm, want = entry.algorithm, entry.hexdigest
        if algorithm != want_algorithm or hexdigest != want:
            raise CheckpointCorrupt(f"{info.url}/{name}: {algorithm} {hexdigest[:12]}… does not match the manifest")
        self._digests_ok.add((info.step, info.fingerprint, name))

    def files_verified(self, info: CheckpointInfo) -> set[str]:
        """Files of `info` this process has read through their digests (reads, `verify`, chunk reads)."""
        return {name for step, fp, name in self._digests_ok if (step, fp) == (info.step, info.fingerprint)}

    def read_file(self, info: CheckpointInfo, name: str) -> bytes:
        """One payload file, checked against the manifest's size and digest."""
        algorithm = self.manifest_entry(info, name).algorithm
        try:
            data = self.fs.cat_file(self._path(info.name, name))
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{info.url}/{name} is missing") from None
        except IsADirectoryError:
            raise CheckpointCorrupt(f"{info.url}/{name} is a directory") from None
        h = new_digest(algorithm)
        h.update(data)
        self.check_digest(info, name, len(data), h.hexdigest(), algorithm)
        return data

    def verify_file(self, info: CheckpointInfo, name: str, chunk_bytes: int = 16 << 20) -> None:
        """Stream one file through its digest (memory: one chunk); raises CheckpointCorrupt. A safetensors
        file's tensors are checked for inf and NaN on the same bytes (NonFiniteTensor, after the digest)."""
        algorithm = self.manifest_entry(info, name).algorithm
        h, n = new_digest(algorithm), 0
        what = f"{info.url}/{name}"
        scan = None
        if is_tensor_file(name):
            size = self.manifest_entry(info, name).bytes
            scan = FiniteScan(
                lambda raw: parse_safetensors_header(lambda s, k: raw[s : s + k], size, what), MAX_HEADER_BYTES
            )
        try:
            with self.fs.open(self._path(info.name, name), "rb") as f:
                while chunk := f.read(chunk_bytes):
                    h.update(chunk)
                    if scan is not None:
                        scan.update(chunk)
                    n += len(chunk)
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointCorrupt(f"{what} is missing or not a file") from None
        self.check_digest(info, name, n, h.hexdigest(), algorithm)
        if scan is not None and scan.bad:
            raise NonFiniteTensor(
                f"{what}: {len(scan.bad)} tensor(s) hold inf or NaN values ({', '.join(scan.bad[:5])}); a checkpoint "
                "with non-finite weights is invalid (resuming from it would train nothing but NaN)"
            )

    def read_tensors(self, info: CheckpointInfo, name: str) -> dict[str, torch.Tensor]:
        """A safetensors payload, digest-checked and its header checked before the library parses it."""
        data = self.read_file(info, name)
        parse_safetensors_header(lambda start, n: data[start : start + n], len(data), f"{info.url}/{name}")
        tensors = safetensors_load(data)
        for key, t in tensors.items():
            check_finite(key, t, f"{info.url}/{name}")
        return tensors

    def read_json(self, info: CheckpointInfo, name: str) -> Any:
        """A JSON payload, digest-checked and, for the state files gentrain reads, checked against its schema."""
        return _parse_json_payload(name, self.read_file(info, name), info)

    def read_safetensors_header(self, info: CheckpointInfo, name: str) -> tuple[dict[str, Any], int]:
        """A payload's safetensors header (checked) and its data offset, by ranged reads (no digest)."""
        path = self._path(info.name, name)
        size = self.manifest_entry(info, name).bytes
        what = f"{info.url}/{name}"
        try:
            with self.fs.open(path, "rb") as f:

                def read(start: int, n: int) -> bytes:
                    f.seek(start)
                    return f.read(n)

                return parse_safetensors_header(read, size, what)
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointCorrupt(f"{what} is missing or not a file") from None

    def verify(self, info: CheckpointInfo, digests_checked: Iterable[str] = ()) -> list[str]:
        """Full check: every file's size and digest (streamed) and structure (safetensors headers, JSON
        state schemas, tensors the state refers to); the problems found, none if valid. Files named in
        `digests_checked` were read through their digests already (a resume's reads) and are not hashed again."""
        if not info.valid:
            return [info.reason]
        problems: list[str] = []
        parsed: dict[str, Any] = {}
        skip = set(digests_checked)
        for name in info.manifest.files:
            try:
                if name not in skip:
                    self.verify_file(info, name)
                if is_tensor_file(name):
                    parsed[name] = self.read_safetensors_header(info, name)[0]
                    if is_rank_tensors(name):  # small: its RNG state is read and tried on scratch generators
                        partner = name.removesuffix(".safetensors") + ".json"
                        if partner not in info.manifest.files:  # a resume reads both: one without the other
                            raise CheckpointCorrupt(f"{info.url}: {name} is listed without its {partner}")
                        check_rank_tensors(self.read_tensors(info, name), f"{info.url}/{name}")
                elif name.endswith(".json"):
                    parsed[name] = self.read_json(info, name)
            except CheckpointCorrupt as e:
                problems.append(str(e))
        if not problems:
            problems += _cross_check(info, parsed)
        if not problems:
            self._verified.add((info.step, info.fingerprint))
        return problems


def _parse_json_payload(name: str, raw: bytes, info: CheckpointInfo) -> Any:
    what = f"{info.url}/{name}"
    try:
        if name == TRAINER_JSON:
            return parse_trainer_json(raw, info.step)
        if name == SHARD_INDEX:
            return parse_shard_index(raw, info.manifest.files if info.manifest is not None else {})
        if is_rank_json(name):
            return parse_rank_json(raw)
        return parse_json(raw, name)
    except CheckpointCorrupt as e:
        raise CheckpointCorrupt(f"{what}: {e}") from None


def _cross_check(info: CheckpointInfo, parsed: Mapping[str, Any]) -> list[str]:
    """Structure across files: what trainer.json and shards.json refer to exists, EMA fits its weights."""
    problems = []
    files = info.manifest.files
    index = parsed.get(SHARD_INDEX)
    if index is not None:
        for group, tensors in index.tensors.items():
            for key, t in tensors.items():
                for c in t.chunks:
                    h = (parsed.get(c.file) or {}).get(key)
                    if h is None or h["dtype"] != t.dtype or h["shape"] != c.sizes:
                        problems.append(f"{info.url}/{c.file}: {group}:{key} does not match shards.json")
    if TRAINER_JSON in files and not isinstance(info.manifest.config, dict):
        # A training checkpoint: sampling and export build the model from its config, so one without it
        # would verify and then not load there.
        problems.append(f"{info.url}: manifest.json holds no config (a mapping) for {TRAINER_JSON}'s run")
    doc = parsed.get(TRAINER_JSON)
    if doc is not None:
        for part, state in doc.parts.items():
            refs = tensor_refs(state.optimizer)
            group = group_name(part, "optimizer")
            indexed = index.tensors if index is not None else {}
            saved = set(indexed.get(group, {})) | set(parsed.get(whole_file(group)) or {})
            if refs - saved:
                problems.append(f"{info.url}: {group} lacks tensors trainer.json refers to: {sorted(refs - saved)[:3]}")
            model = group_name(part, "model")
            if whole_file(model) not in files and model not in indexed:
                problems.append(f"{info.url}: trainer.json has part {part!r}, but no weights of it are listed")
    for name, header in parsed.items():
        g = parse_group_file(name)
        if g is not None and g.kind == "ema" and g.whole:
            model_name = whole_file(group_name(g.part, "model"))
            if (model := parsed.get(model_name)) is not None:
                problem = _ema_mismatch(
                    info, name, header, model_name, model, parsed.get(whole_file(group_name(g.part, "optimizer")))
                )
                if problem:
                    problems.append(problem)
    return problems


def _ema_mismatch(
    info: CheckpointInfo,
    ema_name: str,
    ema: Mapping[str, Any],
    model_name: str,
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None,
) -> str | None:
    """EMA weights that do not match the online weights, naming the file that is wrong where the checkpoint
    tells: the optimizer's per-parameter tensors (AdamW's exp_avg) are shaped like the parameters, so the
    file whose shapes they agree with is the sound one. Otherwise both files are named (the model that
    `checkpoints verify` builds from the config tells which one is wrong)."""
    key = next((k for k, h in ema.items() if k not in model or model[k]["shape"] != h["shape"]), None)
    if key is None:
        return None
    if key not in model:
        return f"{info.url}/{ema_name}: {key} has no weight in {model_name}"
    moments = Counter(tuple(h["shape"]) for k, h in (optimizer or {}).items() if k.endswith(".exp_avg"))
    in_ema = Counter(tuple(h["shape"]) for h in ema.values())
    in_model = Counter(tuple(model[k]["shape"]) for k in ema if k in model)
    in_model_file, in_ema_file = model[key]["shape"], ema[key]["shape"]
    if moments and moments == in_ema != in_model:
        return (
            f"{info.url}/{model_name}: {key} has shape {in_model_file}, "
            f"its EMA weights and optimizer state {in_ema_file}"
        )
    if moments and moments == in_model != in_ema:
        return (
            f"{info.url}/{ema_name}: {key} has shape {in_ema_file}, "
            f"its model weights and optimizer state {in_model_file}"
        )
    return (
        f"{info.url}: {model_name} and {ema_name} disagree on {key} "
        f"({in_model_file} in {model_name}, {in_ema_file} in {ema_name})"
    )


class InvalidCheckpoint(CheckpointCorrupt):
    """The step dir a URL names is not a valid checkpoint; `info` says which and why (`info.reason`)."""

    def __init__(self, info: CheckpointInfo):
        super().__init__(f"{info.url}: {info.reason}")
        self.info = info


def resolve_checkpoint(url: str, storage_options: Mapping[str, Any] | None = None) -> CheckpointView | None:
    """A URL that is either one checkpoint (step-NNN) or a root; returns the view of its checkpoint (the view's
    `reader` reads the rest of the root), fully checked: what `checkpoints verify` and a frozen part's source
    run read from.

    For a root, the newest valid checkpoint (digests and structure verified: a corrupt newest one is
    skipped with a warning), None when it has none; for a step dir, that one, or InvalidCheckpoint
    saying why it is not valid.
    """
    url = url.rstrip("/")
    base = posixpath.basename(url)
    step = parse_step_dir(base)
    if step is not None:
        reader = CheckpointReader(url[: -len(base) - 1] or ".", storage_options)
        info = reader.check(step)
        problems = reader.verify(info) if info.valid else []
        if problems:
            info = CheckpointInfo(info.url, info.step, False, "; ".join(problems), info.manifest, info.fingerprint)
        if not info.valid:
            raise InvalidCheckpoint(info)
        return reader.view(info)
    reader = CheckpointReader(url, storage_options)
    info = reader.latest_valid(deep=True)
    return reader.view(info) if info is not None else None
