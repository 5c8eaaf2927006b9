"""Feature networks for FID/KID: the shipped digits net, a net the user gives (safetensors + JSON), or Inception.
(The digits net and the CNN a user's net must be are `trainer.conditioning.feature_cnn`, which conditioning uses too.)

Published FID/KID numbers use the TF-ported Inception-v3 weights; those are
not on PyPI and cannot be downloaded here, so `eval.features=inception` needs
them at `eval.features_url` (and torch-fidelity for the network code).
Values from any other network (the digits net included) are only comparable
with values from the same network: the JSON written next to every result
names the network and its digest.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import tempfile

import torch
from torch import nn

from trainer.conditioning.feature_cnn import build_cnn, shipped_digits
from trainer.errors import ConfigError

INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"


class _InceptionFeatures(nn.Module):
    """torchmetrics' FID Inception (torch-fidelity's port) on [0, 1] images of any channel count.

    torch-fidelity's constructor insists on loading a weights file itself, with
    `torch.load(path, weights_only=False)` (0.4.0; plain `torch.load` before),
    which unpickles whatever the file holds. So it never sees the user's file:
    gentrain loads that with `weights_only=True` (or as safetensors) and hands
    the constructor a file it wrote itself from those tensors alone, in a private
    temporary folder removed right after.
    """

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        from torchmetrics.image.fid import NoTrainInceptionV3

        with tempfile.TemporaryDirectory(prefix="gentrain-inception-") as tmp:  # mode 0o700
            path = os.path.join(tmp, INCEPTION_FILE)
            torch.save(state, path)
            self.net = NoTrainInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=path)
        self.num_features = 2048

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return self.net((x.clamp(0, 1) * 255).to(torch.uint8)).double()


def require_torchmetrics() -> None:
    """FID/KID are torchmetrics' (the `eval` extra): a ConfigError (exit 2) naming it when it is missing."""
    try:
        import torchmetrics  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"FID/KID (gentrain eval, eval.every_steps > 0) need torchmetrics, which is not installed ({e}): "
            "pip install 'gentrain[eval]', or set eval.every_steps=0 to train without evaluation"
        ) from None


def load_features(name: str, url: str | None, storage_options: dict | None = None) -> tuple[nn.Module, dict]:
    """(feature network, description for the result JSON); ConfigError (exit 2) names what is missing."""
    import blake3

    require_torchmetrics()  # every caller measures FID/KID with these features next

    if name == "digits":
        desc, tensors, raw = shipped_digits()
        return build_cnn(desc, tensors), {
            "features": "digits",
            "digest": blake3.blake3(raw).hexdigest(),
            **_about(desc),
        }
    if name == "inception":
        return _inception(url, storage_options)
    if "/" in name or "://" in name:
        return _user_net(name, storage_options)
    raise ConfigError(
        f"eval.features={name!r} is unknown: use digits (shipped), inception (with eval.features_url), "
        "or the URL of a folder holding features.json + features.safetensors"
    )


def _about(desc: dict) -> dict:
    return {k: desc[k] for k in ("architecture", "feature_dim", "input_size", "trained_on", "accuracy") if k in desc}


def _user_net(url: str, storage_options: dict | None) -> tuple[nn.Module, dict]:
    import blake3
    import fsspec
    from safetensors.torch import load

    fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    try:
        desc = json.loads(fs.cat_file(posixpath.join(root, "features.json")))
        raw = fs.cat_file(posixpath.join(root, "features.safetensors"))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        raise ConfigError(
            f"eval.features={url!r}: {e.filename or e} is missing; a feature network is a folder with "
            "features.json (architecture, channels, input_size, widths, feature_dim) and features.safetensors"
        ) from None
    net = build_cnn(desc, load(raw))
    return net, {"features": url, "digest": blake3.blake3(raw).hexdigest(), **_about(desc)}


def _inception(url: str | None, storage_options: dict | None) -> tuple[nn.Module, dict]:
    import blake3

    if not url:
        raise ConfigError(
            f"eval.features=inception needs eval.features_url: the path or URL of {INCEPTION_FILE} (the FID "
            "Inception weights torch-fidelity uses); they are not downloaded at run time. Or use eval.features=digits, "
            "or eval.every_steps=0 to train without evaluation"
        )
    raw = _read_weights_file(url, storage_options)
    # The weights are read (and a pickle refused) before anything else: a bad file is the first thing to fix.
    state = inception_state_dict(raw, url)
    try:
        import torch_fidelity  # noqa: F401
    except ImportError:
        raise ConfigError(
            "eval.features=inception needs the torch-fidelity package for the network code "
            "(pip install 'gentrain[inception]', with a torchvision that matches your torch build); its weights "
            "still come from eval.features_url"
        ) from None
    net = _InceptionFeatures(state)
    return net, {"features": "inception", "digest": blake3.blake3(raw).hexdigest(), "feature_dim": 2048}


def _read_weights_file(url: str, storage_options: dict | None) -> bytes:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        return fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"eval.features_url={url!r} does not exist (expected {INCEPTION_FILE})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"eval.features_url={url!r} cannot be read: {e}") from None


def inception_state_dict(raw: bytes, url: str) -> dict[str, torch.Tensor]:
    """The tensors of an Inception weights file: safetensors, or a PyTorch file loaded with
    `weights_only=True` whatever the torch version, so a pickle that would run code is refused (exit 2)."""
    from safetensors.torch import load as load_safetensors

    if raw[8:9] == b"{":  # a safetensors file: 8-byte header length, then the JSON header
        try:
            return load_safetensors(raw)
        except Exception as e:  # noqa: BLE001 - any failure to parse is "not a weights file"; said below
            raise ConfigError(f"eval.features_url={url!r}: not a readable safetensors file ({e})") from None
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler raises many types for a hostile or broken file
        raise ConfigError(
            f"eval.features_url={url!r} is not a plain weights file: torch.load(weights_only=True) refused it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). gentrain never unpickles "
            f"anything else; use {INCEPTION_FILE} as torch-fidelity publishes it, or its tensors as safetensors"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ConfigError(f"eval.features_url={url!r}: holds {type(state).__name__}, not a state dict of tensors")
    return state
