"""The cost-model interface, and how ranking quality is measured.

A program's features are its statement rows (an array of shape
``(statements, N_FEATURES)``, see `search/features/`); a cost model scores
whole programs: the higher the score, the faster it predicts the program.
Only the order of scores matters to the search.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence

import numpy as np

Features = np.ndarray
"""One program's features: (statements, N_FEATURES)."""


class CostModel(abc.ABC):
    """Learns from measured programs; scores unmeasured ones in batches."""

    @abc.abstractmethod
    def update(self, records: Sequence[tuple[Features, float]]) -> None:
        """Add measured programs, each (features, throughput in FLOP/s; 0 for
        a program that failed), and retrain on everything seen so far."""

    @abc.abstractmethod
    def predict(self, batch: Sequence[Features]) -> np.ndarray:
        """One score per program (higher = predicted faster)."""

    @property
    def trained(self) -> bool:
        """Whether predictions carry information (an untrained model's do not)."""
        return True

    @property
    def records_to_train(self) -> int | None:
        """How many records `update` needs before it trains (fewer are only
        kept), or None for a model that never learns from records. The
        search extracts no features before then: a model tune spreads over
        many tasks gives most of them a few trials each."""
        return 1

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Write the model to `path`."""

    @abc.abstractmethod
    def load(self, path: str | os.PathLike) -> None:
        """Replace this model by the one saved at `path`."""


def pairwise_accuracy(scores: Sequence[float], throughputs: Sequence[float]) -> float:
    """Share of pairs with different throughputs that `scores` order the
    same way (0.5 = chance, 1.0 = a perfect ranking)."""
    s = np.asarray(scores, float)
    t = np.asarray(throughputs, float)
    ds = s[:, None] - s[None, :]
    dt = t[:, None] - t[None, :]
    mask = dt > 0
    if not mask.any():
        return float("nan")
    return float(((ds > 0) & mask).sum() + 0.5 * ((ds == 0) & mask).sum()) / float(mask.sum())
