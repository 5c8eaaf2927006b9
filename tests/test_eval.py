"""FID/KID: the shipped digits features, sanity against the formula, the eval CLI, 2 ranks equal 1 rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg
import torch
from conftest import run_cli, tiny
from elastic_helpers import standalone, start_torchrun
from helpers import kill_group

from trainer.data.datasets import DigitsDataset
from trainer.eval.features import INCEPTION_FILE, load_features
from trainer.eval.fid import FidKid


def digits01(n: int, start: int = 0) -> torch.Tensor:
    ds = DigitsDataset(16, 1)
    return (ds.images[start : start + n] + 1) / 2


def fid_kid(net, real: torch.Tensor, fake: torch.Tensor, subset: int = 50) -> dict:
    m = FidKid(net, subset, torch.device("cpu"))
    m.update(real, real=True)
    m.update(fake, real=False)
    return m.compute(len(real), len(fake))


def frechet(a: np.ndarray, b: np.ndarray) -> float:
    """The FID formula (Heusel et al. 2017) computed directly with scipy."""
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def test_shipped_digits_features_fid_kid_are_zero_on_the_same_set_small_across_digits_large_against_noise():
    net, about = load_features("digits", None)
    assert about["features"] == "digits" and about["accuracy"] >= 0.95 and len(about["digest"]) == 64
    a, b = digits01(400), digits01(400, start=800)
    noise = torch.rand(400, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    same, across, vs_noise = fid_kid(net, a, a), fid_kid(net, a, b), fid_kid(net, a, noise)
    assert abs(same["fid"]) < 1e-3 * across["fid"] + 1e-6
    assert across["fid"] > 0 and across["kid"] < vs_noise["kid"]
    assert vs_noise["fid"] > 20 * across["fid"] and vs_noise["kid"] > 20 * abs(same["kid"])
    # torchmetrics' value is the formula on the network's features (float64 statistics, sqrtm tolerance).
    with torch.no_grad():
        fa, fb = net.features(a).double().numpy(), net.features(b).double().numpy()
    assert across["fid"] == pytest.approx(frechet(fa, fb), rel=1e-4)


@pytest.mark.slow
def test_feature_networks_that_are_not_there_are_exit_2_errors_naming_the_file(tmp_path):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=INCEPTION_FILE):
        load_features("inception", None)
    with pytest.raises(ConfigError, match="features.json"):
        load_features(str(tmp_path / "nothing"), None)
    r = run_cli("train", *tiny(tmp_path, "eval.every_steps=1", "eval.features=inception", max_steps=2))
    assert r.returncode == 2 and INCEPTION_FILE in r.stderr and "eval.features_url" in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_user_feature_network_from_a_folder_gives_the_same_values_as_the_shipped_one(tmp_path):
    from safetensors.torch import save_file

    from trainer.conditioning.feature_cnn import shipped_digits

    desc, tensors, _ = shipped_digits()
    (tmp_path / "features.json").write_text(json.dumps(desc))
    save_file(tensors, tmp_path / "features.safetensors")
    mine, about = load_features(str(tmp_path), None)
    shipped, _ = load_features("digits", None)
    assert about["features"] == str(tmp_path)
    a, b = digits01(64), digits01(64, start=500)
    assert fid_kid(mine, a, b)["fid"] == fid_kid(shipped, a, b)["fid"]


def test_ranks_with_fewer_generated_chunks_keep_step_with_a_sharded_sampler():
    from trainer.eval.fid import generated_images

    calls = {0: [], 1: []}

    def sampler(rank):
        def sample(count, seed):
            calls[rank].append((count, seed))
            return torch.zeros(count, 1, 2, 2)

        return sample

    # 40 images = chunks of 16, 16, 8: rank 0 takes two, rank 1 one (the 8) and, in lockstep, one throwaway.
    got = {r: [len(x) for x in generated_images(sampler(r), 40, 7, r, 2, lockstep=True)] for r in (0, 1)}
    assert got == {0: [16, 16], 1: [8]}
    assert len(calls[0]) == len(calls[1]) == 2 and calls[1][1][0] == 1
    assert calls[1][0][1] not in {seed for _, seed in calls[0]}  # chunk 2's seed is its own
    assert [len(x) for x in generated_images(sampler(1), 40, 7, 1, 2)] == [8] and len(calls[1]) == 3


def test_evaluation_needs_a_real_image_per_rank():
    from trainer.config import ConfigError
    from trainer.eval.fid import check_share

    check_share(2, 2)
    with pytest.raises(ConfigError, match="at least 3 real images"):
        check_share(2, 3)


@pytest.mark.slow
def test_training_evaluates_periodically_and_eval_cli_over_2_ranks_equals_1_rank(tmp_path):
    # 48 images = 3 chunks of 16: over 2 ranks one takes two and the other one (uneven KID lists once
    # made the ranks issue different numbers of gathers and wait forever).
    args = tiny(tmp_path, "eval.every_steps=2", "eval.num=48", "checkpoint.every_steps=2", max_steps=2)
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval step=2 fid=" in r.stderr
    root = tmp_path / "run" / "checkpoints"
    during = json.loads((root / "eval-000000002.json").read_text())
    assert during["num_generated"] == 48 and during["num_real"] == 48 and during["features"] == "digits"
    (root / "eval-000000002.json").unlink()

    one = run_cli("eval", str(root))  # eval.num=48 comes from the run's config
    assert one.returncode == 0, one.stderr[-3000:]
    single = json.loads((root / "eval-000000002.json").read_text())
    assert single["fid"] > 0 and single["world_size"] == 1
    # Same images, same statistics: the training-time evaluation saw the same EMA weights.
    assert single["fid"] == pytest.approx(during["fid"], rel=1e-6)

    def two_ranks(num: int) -> dict:
        (root / "eval-000000002.json").unlink()
        log = tmp_path / f"eval2-{num}.log"
        # torchrun's parser refuses --num
        proc = start_torchrun(standalone(2), [str(root), "--num-images", str(num)], log, command=("eval",))
        try:
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        finally:
            kill_group(proc)
        return json.loads((root / "eval-000000002.json").read_text())

    double = two_ranks(48)
    assert double["world_size"] == 2 and double["num_real"] == 48
    assert double["fid"] == pytest.approx(single["fid"], rel=1e-6)
    assert double["kid"] == pytest.approx(single["kid"], rel=1e-5, abs=1e-9)
    # 16 images = 1 chunk: rank 1 generates nothing (an empty KID share of the features' dtype).
    (root / "eval-000000002.json").unlink()
    assert run_cli("eval", str(root), "--num", "16").returncode == 0
    single16 = json.loads((root / "eval-000000002.json").read_text())
    double16 = two_ranks(16)
    assert double16["num_generated"] == single16["num_generated"] == 16
    assert double16["fid"] == pytest.approx(single16["fid"], rel=1e-6)
    assert double16["kid"] == pytest.approx(single16["kid"], rel=1e-5, abs=1e-9)
