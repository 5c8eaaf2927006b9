"""Edit a real checkpoint root the way anyone with write access to its bucket could (tests only)."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import torch
from safetensors.torch import load_file, save_file


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def manifest(root: Path, step: int) -> dict:
    return json.loads((step_dir(root, step) / "manifest.json").read_text())


def write_manifest(root: Path, step: int, doc) -> None:
    (step_dir(root, step) / "manifest.json").write_text(json.dumps(doc))


def replace_file(root: Path, step: int, name: str, data: bytes) -> None:
    """Replace a payload file and make the manifest agree (size and digest): only structure can catch it."""
    d = step_dir(root, step)
    (d / name).write_bytes(data)
    doc = manifest(root, step)
    doc["files"][name] = {"bytes": len(data), "blake3": blake3.blake3(data).hexdigest()}
    write_manifest(root, step, doc)


def flip_byte(root: Path, step: int, name: str, offset: int = -1) -> None:
    """Corrupt one byte of a payload file, leaving its size (and the manifest) as they were."""
    path = step_dir(root, step) / name
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_json(root: Path, step: int, name: str, edit) -> None:
    doc = json.loads((step_dir(root, step) / name).read_text())
    replace_file(root, step, name, json.dumps(edit(doc)).encode())


def edit_tensors(root: Path, step: int, name: str, edit) -> None:
    path = step_dir(root, step) / name
    tensors = edit(load_file(str(path)))
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    replace_file(root, step, name, tmp.read_bytes())
    tmp.unlink()


def read_tensors(root: Path, step: int, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir(root, step) / name))
