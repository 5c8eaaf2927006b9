"""A digits classifier for judging generated digits: logistic regression on the 8x8 UCI digits.

Samples of any resolution are area-downsampled to 8x8 and scaled to the
dataset's 0..16 range. Used by bench/cascade_digits.py and the cascade tests;
scikit-learn does the fitting (it ships with the environment).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data.datasets import load_digits_arrays


def fit_digits_classifier():
    from sklearn.linear_model import LogisticRegression

    images, labels = load_digits_arrays()
    return LogisticRegression(max_iter=2000).fit(images.reshape(len(images), -1).astype(np.float64), labels)


def class_accuracy(classifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of `images` (N, 1, H, W) in [0, 1] that the classifier assigns to `labels`."""
    x = F.interpolate(images.float(), size=(8, 8), mode="area") if images.shape[-1] != 8 else images.float()
    pred = classifier.predict((x.clamp(0, 1) * 16).reshape(len(x), -1).numpy().astype(np.float64))
    return float((torch.from_numpy(pred) == labels.cpu()).float().mean())
