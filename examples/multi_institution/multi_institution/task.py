"""Model, data and training loop of the multi-institution example.

Five (or more) institutions each hold a non-IID slice of scikit-learn's bundled ``digits`` data
set (8x8 images, 10 classes, 1797 samples, shipped inside scikit-learn: nothing is downloaded).
The split is a Dirichlet draw over labels with a fixed seed, so every run sees the same slices.
A held-out global test set (the same for every run) measures the federated model centrally.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

#: Fraction of the whole data set kept aside as the global (server-side) test set.
GLOBAL_TEST_FRACTION = 0.2
#: Fraction of each institution's slice kept for its local evaluation.
LOCAL_TEST_FRACTION = 0.2
#: Smallest number of samples an institution's slice may have (the split is redrawn below it).
MIN_PARTITION_SAMPLES = 40
#: How many Dirichlet redraws are tried before giving up on ``MIN_PARTITION_SAMPLES``.
MAX_REDRAWS = 100

NUM_FEATURES = 64
NUM_CLASSES = 10


class Net(nn.Module):
    """A small MLP: 64 -> hidden -> hidden -> 10."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # type: ignore[no-any-return]


def make_model(seed: int, hidden: int = 64) -> Net:
    """Build the model with weights fixed by ``seed``."""
    torch.manual_seed(seed)
    return Net(hidden)


@lru_cache(maxsize=4)
def _dataset(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(x_pool, y_pool, x_test, y_test)``: scaled features, global test split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = round(len(y) * GLOBAL_TEST_FRACTION)
    test, pool = order[:n_test], order[n_test:]
    return x[pool], y[pool], x[test], y[test]


@lru_cache(maxsize=8)
def partition_indices(num_partitions: int, alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    """Split the training pool across institutions, non-IID by a Dirichlet over labels.

    For each class, the class's samples are shared among the institutions in proportions drawn
    from ``Dirichlet(alpha)``; a small ``alpha`` gives very skewed institutions. The draw is
    redone (same generator, so still deterministic) until every slice has at least
    ``MIN_PARTITION_SAMPLES`` samples.
    """
    if num_partitions < 1:
        raise ValueError(f"num-partitions must be at least 1, got {num_partitions}")
    _, y, _, _ = _dataset(seed)
    rng = np.random.default_rng(seed + 1)
    for _ in range(MAX_REDRAWS):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for label in range(NUM_CLASSES):
            idx = np.flatnonzero(y == label)
            idx = idx[rng.permutation(len(idx))]
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for part, chunk in zip(parts, np.split(idx, cuts), strict=True):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= MIN_PARTITION_SAMPLES:
            return tuple(np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
    raise ValueError(
        f"dirichlet-alpha={alpha} with num-partitions={num_partitions} cannot give every "
        f"institution {MIN_PARTITION_SAMPLES} samples; raise dirichlet-alpha or use fewer "
        "partitions"
    )


def load_partition(
    partition_id: int, num_partitions: int, alpha: float, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Return ``((x_train, y_train), (x_val, y_val))`` of one institution."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id must be in [0, {num_partitions}), got {partition_id}")
    x, y, _, _ = _dataset(seed)
    idx = partition_indices(num_partitions, alpha, seed)[partition_id]
    rng = np.random.default_rng(seed + 2 + partition_id)
    idx = idx[rng.permutation(len(idx))]
    n_val = max(1, round(len(idx) * LOCAL_TEST_FRACTION))
    val, train = idx[:n_val], idx[n_val:]
    return (
        (torch.from_numpy(x[train]), torch.from_numpy(y[train])),
        (torch.from_numpy(x[val]), torch.from_numpy(y[val])),
    )


def load_global_test(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the global test set (never seen by any institution)."""
    _, _, x, y = _dataset(seed)
    return torch.from_numpy(x), torch.from_numpy(y)


def train(
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    proximal_mu: float = 0.0,
) -> float:
    """Train ``model`` in place with SGD; return the mean training loss of the last epoch.

    With ``proximal_mu > 0`` the FedProx proximal term ``mu/2 * ||w - w_global||^2`` is added.
    """
    x, y = data
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    global_params = [p.detach().clone() for p in model.parameters()]
    model.train()
    last = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        total, count = 0.0, 0
        for start in range(0, len(y), batch_size):
            batch = order[start : start + batch_size]
            opt.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            if proximal_mu > 0.0:
                prox = sum(
                    ((p - g) ** 2).sum()
                    for p, g in zip(model.parameters(), global_params, strict=True)
                )
                loss = loss + 0.5 * proximal_mu * prox
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.item()) * len(batch)
            count += len(batch)
        last = total / max(count, 1)
    return last


@torch.no_grad()
def evaluate(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Return ``(loss, accuracy)`` of ``model`` on ``data``."""
    x, y = data
    model.eval()
    logits = model(x)
    loss = float(nn.functional.cross_entropy(logits, y).item())
    acc = float((logits.argmax(dim=1) == y).float().mean().item())
    return loss, acc
