"""The checkpoint layout module: every name built and parsed back, and the safetensors dtype table."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from trainer.checkpoint import layout
from trainer.checkpoint.format import DTYPE_NAMES, SAFETENSORS_DTYPES, torch_dtype, write_safetensors

PARTS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)


@given(step=st.integers(0, 10**12))
def test_step_dir_names_parse_back(step):
    name = layout.step_dir_name(step)
    assert layout.parse_step_dir(name) == step
    assert name == f"step-{step:09d}"


@pytest.mark.parametrize("name", ["step-1", "step-00000001a", "step--00000001", "xstep-000000001", "step-000000001/"])
def test_other_names_are_not_step_dirs(name):
    assert layout.parse_step_dir(name) is None


@given(part=PARTS, kind=st.sampled_from(layout.KINDS), rank=st.integers(0, 99999))
def test_group_file_names_parse_back(part, kind, rank):
    group = layout.group_name(part, kind)
    whole = layout.parse_group_file(layout.whole_file(group))
    shard = layout.parse_group_file(layout.shard_file(group, rank))
    replicated = layout.parse_group_file(layout.replicated_file(group))
    assert whole == layout.GroupFile(part, kind) and whole.whole and whole.group == group
    assert shard == layout.GroupFile(part, kind, rank=rank) and not shard.whole
    assert replicated == layout.GroupFile(part, kind, replicated=True) and not replicated.whole
    assert layout.parse_group(group) == layout.GroupFile(part, kind)
    assert layout.parse_group(layout.whole_file(group)) == whole


def test_named_files_are_the_group_files():
    assert layout.model_file("unet") == "unet.model.safetensors"
    assert layout.ema_file("unet") == "unet.ema.safetensors"
    assert layout.optimizer_file("unet") == "unet.optimizer.safetensors"
    assert layout.rank_files(3) == ("rank-00003.safetensors", "rank-00003.json")
    with pytest.raises(ValueError, match="unknown tensor group kind"):
        layout.group_name("unet", "weights")


@pytest.mark.parametrize(
    "name",
    [
        layout.MANIFEST,
        layout.TRAINER_JSON,
        layout.SHARD_INDEX,
        "rank-00000.safetensors",
        "unet.model.json",
        "unet.weights.safetensors",
        "unet.ema.rank-1.safetensors",  # rank numbers have five digits or more
        "a.b.model.safetensors",  # part names have no dot
        ".model.safetensors",
    ],
)
def test_other_files_are_not_group_files(name):
    assert layout.parse_group_file(name) is None


def test_rank_json_is_recognised():
    assert layout.is_rank_json("rank-00002.json") and layout.is_rank_json("rank-123456.json")
    assert not layout.is_rank_json("rank-00002.safetensors") and not layout.is_rank_json("rank-2.json")


def test_group_files_and_parts_in_both_layouts():
    whole = ["manifest.json", "trainer.json", "unet.model.safetensors", "unet.ema.safetensors", "rank-00000.json"]
    assert layout.group_files(whole, "unet.ema") == ["unet.ema.safetensors"]
    assert layout.group_files(whole, "unet.optimizer") == []
    sharded = [
        "shards.json",
        "unet.model.rank-00001.safetensors",
        "unet.model.rank-00000.safetensors",
        "unet.model.replicated.safetensors",
        "unet.modelx.rank-00000.safetensors",
        "vae.model.rank-00000.safetensors",
    ]
    assert layout.group_files(sharded, "unet.model") == [
        "unet.model.rank-00000.safetensors",
        "unet.model.rank-00001.safetensors",
        "unet.model.replicated.safetensors",
    ]
    assert layout.parts_with_weights(whole + sharded) == ["unet", "vae"]


def _header(raw: bytes) -> dict:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_dtype_table_is_every_dtype_safetensors_round_trips():
    """Our table names exactly the torch dtypes the safetensors library saves and loads back, by the
    names it writes; a safetensors upgrade that learns to load another one fails here to say so."""
    round_trips = {}
    for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
        try:
            raw = safetensors_save({"t": torch.zeros(2, dtype=dtype)})
            back = safetensors_load(raw)["t"]
        except Exception:  # safetensors cannot write or read it back: a checkpoint cannot hold it  # noqa: BLE001
            continue
        if back.dtype == dtype:
            round_trips[dtype] = _header(raw)["t"]["dtype"]
    assert round_trips, "safetensors round-tripped no dtype at all"
    assert DTYPE_NAMES == round_trips
    for name in ("F8_E4M3", "F8_E5M2", "U16", "U32", "U64"):
        assert name in SAFETENSORS_DTYPES
    assert all(torch_dtype(DTYPE_NAMES[d]) == d for d in DTYPE_NAMES)
    with pytest.raises(ValueError, match="unknown safetensors dtype"):
        torch_dtype("F7")


@pytest.mark.parametrize("dtype", sorted(SAFETENSORS_DTYPES.values(), key=str))
def test_our_writer_round_trips_every_dtype_through_the_safetensors_library(dtype):
    g = torch.Generator().manual_seed(0)
    high = 2 if dtype == torch.bool else 256  # any bit pattern, except that a bool byte is 0 or 1
    t = torch.randint(0, high, (3, 5 * dtype.itemsize), dtype=torch.uint8, generator=g).view(dtype)
    buf = io.BytesIO()
    write_safetensors(buf, {"t": t, "empty": torch.zeros(0, 2, dtype=dtype)}, lambda _: None)
    back = safetensors_load(buf.getvalue())
    assert back["t"].dtype == dtype and back["empty"].shape == (0, 2)
    assert torch.equal(back["t"].view(torch.uint8), t.view(torch.uint8))
