"""Model, data and local training of the imaging CNN example.

The images are scikit-learn's bundled ``digits`` (8x8, 10 classes; nothing is downloaded),
upsampled to 32x32 as a stand-in for small scans. Institution ``i`` of ``n`` draws a share
``home_share`` of its samples from its *home* classes (``label % n == i``) and the rest from the
other classes, so each institution sees a skewed label mix. A fixed fifth of the data is a
global test set that no institution trains on.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

#: Side of the upsampled images.
IMAGE_SIDE = 32
#: Upsampling factor from the 8x8 digits.
UPSAMPLE = IMAGE_SIDE // 8
NUM_CLASSES = 10
#: Fraction of the data set kept as the global test set.
TEST_FRACTION = 0.2
#: Bytes per parameter (float32).
PARAM_BYTES = 4


class ScanNet(nn.Module):
    """Two convolution blocks and a wide dense layer: 32x32x1 -> 10 classes."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 64 * (IMAGE_SIDE // 4) ** 2
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def make_model(seed: int, hidden: int) -> ScanNet:
    """The CNN with weights fixed by ``seed``."""
    torch.manual_seed(seed)
    return ScanNet(hidden)


def model_megabytes(model: nn.Module) -> float:
    """Size of the model's parameters in MB (float32)."""
    return sum(p.numel() for p in model.parameters()) * PARAM_BYTES / 1e6


@lru_cache(maxsize=2)
def _images(seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """All images upsampled (N, 1, 32, 32), labels, and a seeded order of the samples."""
    digits = load_digits()
    small = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    big = nn.functional.interpolate(small, scale_factor=UPSAMPLE, mode="bilinear")
    order = np.random.default_rng(seed).permutation(len(digits.target))
    return big, torch.from_numpy(digits.target.astype(np.int64)), order


def _split(seed: int) -> tuple[np.ndarray, np.ndarray]:
    _, _, order = _images(seed)
    n_test = int(len(order) * TEST_FRACTION)
    return order[n_test:], order[:n_test]


def institution_indices(
    institution: int, institutions: int, home_share: float, seed: int
) -> np.ndarray:
    """Sample indices of one institution; the institutions' slices never overlap.

    Each class belongs to one institution as home (``label % institutions``): that institution
    gets a share ``home_share`` of the class's training samples and the others split the rest
    evenly, so about ``home_share`` of an institution's samples are of its home classes.
    """
    if not 0 <= institution < institutions:
        raise ValueError(f"partition-id must be in [0, {institutions}), got {institution}")
    if not 0.0 < home_share <= 1.0:
        raise ValueError(f"home-share must be in (0, 1], got {home_share}")
    _, labels, _ = _images(seed)
    pool, _ = _split(seed)
    pool_labels = labels.numpy()[pool]
    mine: list[np.ndarray] = []
    for label in range(NUM_CLASSES):
        samples = pool[pool_labels == label]
        home = label % institutions
        cut = round(len(samples) * home_share) if institutions > 1 else len(samples)
        if home == institution:
            mine.append(samples[:cut])
            continue
        guests = [i for i in range(institutions) if i != home]
        mine.append(np.array_split(samples[cut:], len(guests))[guests.index(institution)])
    return np.sort(np.concatenate(mine))


def load_institution(
    institution: int, institutions: int, home_share: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels one institution trains on."""
    images, labels, _ = _images(seed)
    idx = torch.from_numpy(institution_indices(institution, institutions, home_share, seed))
    return images[idx], labels[idx]


def load_test(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global test set (no institution trains on it)."""
    images, labels, _ = _images(seed)
    _, test = _split(seed)
    idx = torch.from_numpy(test)
    return images[idx], labels[idx]


def fit(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], cfg: dict[str, float]) -> float:
    """Local training with SGD and, when ``cfg["mu"] > 0``, FedProx's proximal term.

    ``cfg`` holds ``epochs``, ``lr``, ``batch_size``, ``mu`` and ``seed``. Returns the mean
    loss of the last epoch.
    """
    images, labels = data
    anchor = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    generator = torch.Generator().manual_seed(int(cfg["seed"]))
    batch, mu = int(cfg["batch_size"]), cfg["mu"]
    model.train()
    mean = 0.0
    for _ in range(int(cfg["epochs"])):
        losses = []
        for chunk in torch.randperm(len(labels), generator=generator).split(batch):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images[chunk]), labels[chunk])
            if mu > 0.0:
                drift = sum(
                    ((w - a) ** 2).sum() for w, a in zip(model.parameters(), anchor, strict=True)
                )
                loss = loss + 0.5 * mu * drift
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(float(loss.detach()))
        mean = float(np.mean(losses))
    return mean


@torch.no_grad()
def accuracy(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """``(loss, accuracy)`` of ``model`` on ``data``."""
    images, labels = data
    model.eval()
    logits = model(images)
    loss = float(nn.functional.cross_entropy(logits, labels))
    return loss, float((logits.argmax(1) == labels).float().mean())
