"""The model that knows nothing: random scores (the baseline of the others)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from mlir_ansor.search.cost_model.base import CostModel, Features


class RandomModel(CostModel):
    """Uniform random scores from a seeded stream; learns nothing."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def update(self, records: Sequence[tuple[Features, float]]) -> None:
        pass

    def predict(self, batch: Sequence[Features]) -> np.ndarray:
        return self.rng.uniform(size=len(batch))

    @property
    def trained(self) -> bool:
        return False

    @property
    def records_to_train(self) -> None:
        return None

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write("random\n")

    def load(self, path: str | os.PathLike) -> None:
        pass
