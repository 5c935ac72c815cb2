"""XGBoost over statement features, trained on programs (Ansor's pack sum).

Why per-statement rows summed into a program score (Ansor's "pack sum"), and
not one row of aggregated features per program: programs have different
numbers of statements (packing adds a copy, a fused consumer adds a loop
nest), and a program's run time is roughly the sum of its statements'. The
booster predicts one score per statement row; a program's score is the sum
of its rows; the custom objective is a weighted squared error between that
sum and the program's target, and hands each row its program's gradient
(the derivative of a sum).

The target (``XGBModelConfig.target``): by default minus the program's
slowdown against the best program seen (best throughput / throughput =
latency / best latency, capped), which is additive over statements like run
time is, so a sum of statement scores can fit it exactly; Ansor's
normalized throughput (throughput / best) is the alternative ("throughput").
On a synthetic task whose cost is a sum over statements, the slowdown target
ranked held-out programs better (pairwise accuracy 0.87 against 0.80).
Either way each program is weighted by its normalized throughput (at least
``min_weight``), Ansor's weighting: the model spends its capacity on telling
fast programs apart, the ones the search cares about.

Failed programs are kept (throughput 0, i.e. the capped slowdown, with the
smallest weight): the search learns to avoid them too. Every `update`
retrains from scratch on all records (a few hundred programs: well under a
second).

Transfer learning: a model loaded from a file (:meth:`XGBModel.load`, e.g.
one trained offline on an exported dataset, `TuneConfig.pretrained_model`)
predicts at once, and every retraining continues boosting from its trees
(``xgb_model=`` of `xgboost.train`) instead of starting from nothing, so the
records of the new task correct the pretrained model rather than replace it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from mlir_ansor.search.cost_model.base import CostModel, Features


@dataclass(frozen=True)
class XGBModelConfig:
    """Training settings of :class:`XGBModel`.

    rounds: boosting rounds per (re)training.
    max_depth / eta / min_child_weight / subsample: the trees' usual knobs.
    min_weight: loss weight of a program whose normalized throughput is
      below it (failed and slow programs still count a little).
    min_records: programs needed before the model claims to be trained.
    nthread: XGBoost threads (None: XGBoost's default; 1 is deterministic
      and, for a few hundred rows, not slower).
    target: what the sum of a program's statement scores is fitted to:
      "neg_slowdown" (minus best throughput / throughput, i.e. minus the
      latency relative to the best, capped at `max_slowdown`: additive over
      statements, like run time) or "throughput" (Ansor's normalized
      throughput).
    max_slowdown: cap of the slowdown target (failed programs get it).
    max_bin: histogram bins per feature.
    """

    rounds: int = 60
    max_depth: int = 6
    eta: float = 0.2
    min_child_weight: float = 0.5
    subsample: float = 1.0
    min_weight: float = 0.05
    min_records: int = 8
    nthread: int | None = 1
    target: str = "neg_slowdown"
    max_slowdown: float = 20.0
    max_bin: int = 64


class XGBModel(CostModel):
    """Ansor's pack-sum XGBoost model with a throughput-weighted squared loss."""

    def __init__(self, config: XGBModelConfig | None = None, seed: int = 0) -> None:
        self.config = config or XGBModelConfig()
        self.seed = seed
        self.features: list[Features] = []
        self.throughputs: list[float] = []
        self.booster = None
        self.base_model: bytes | None = None  # a loaded model that retraining continues from

    @property
    def trained(self) -> bool:
        return self.booster is not None

    @property
    def records_to_train(self) -> int:
        return self.config.min_records

    def update(self, records: Sequence[tuple[Features, float]]) -> None:
        for f, t in records:
            self.features.append(np.asarray(f, float))
            self.throughputs.append(max(0.0, float(t)) if np.isfinite(t) else 0.0)
        if len(self.features) >= self.config.min_records and max(self.throughputs, default=0) > 0:
            self._train()

    def _params(self) -> dict:
        c = self.config
        p = {
            "max_depth": c.max_depth,
            "eta": c.eta,
            "min_child_weight": c.min_child_weight,
            "subsample": c.subsample,
            "tree_method": "hist",
            "max_bin": c.max_bin,
            "base_score": 0.0,
            "seed": self.seed,
            "disable_default_eval_metric": 1,
            "verbosity": 0,
        }
        if c.nthread is not None:
            p["nthread"] = c.nthread
        return p

    def _train(self) -> None:
        import xgboost as xgb

        rows, ids = _pack(self.features)
        thr = np.asarray(self.throughputs)
        norm = thr / thr.max()
        w = np.maximum(norm, self.config.min_weight)
        if self.config.target == "throughput":
            y = norm
        else:  # minus the slowdown against the best, additive over statements
            y = -np.minimum(1.0 / np.maximum(norm, 1e-12), self.config.max_slowdown)
        n = len(self.features)

        def pack_sum_square_error(preds: np.ndarray, dtrain) -> tuple[np.ndarray, np.ndarray]:
            prog = np.bincount(ids, weights=preds, minlength=n)
            grad = 2.0 * w * (prog - y)
            hess = 2.0 * w
            return grad[ids], hess[ids]

        dtrain = xgb.DMatrix(rows)
        base = bytearray(self.base_model) if self.base_model is not None else None
        self.booster = xgb.train(
            self._params(), dtrain, num_boost_round=self.config.rounds, obj=pack_sum_square_error, xgb_model=base
        )

    def predict(self, batch: Sequence[Features]) -> np.ndarray:
        if self.booster is None or not len(batch):
            return np.zeros(len(batch))
        import xgboost as xgb

        rows, ids = _pack(batch)
        per_row = self.booster.predict(xgb.DMatrix(rows))
        return np.bincount(ids, weights=per_row, minlength=len(batch))

    def save(self, path: str | os.PathLike, *, about: dict | None = None) -> None:
        """One JSON file (gzip-compressed when `path` ends in ``.gz``): the
        booster, the settings and the feature columns it was trained on
        (records are not saved); `about` is kept as it is (what it was
        trained on)."""
        raw = bytes(self.booster.save_raw(raw_format="json")).decode() if self.booster is not None else None
        data = {"config": asdict(self.config), "seed": self.seed, "features": feature_schema(), "booster": raw}
        if about:
            data["about"] = about
        with _open(path, "w") as f:
            json.dump(data, f)

    def load(self, path: str | os.PathLike) -> None:
        """Load a saved model; later retraining continues from it. A model
        trained on other feature columns than this version extracts is an
        error (its trees would read the wrong columns)."""
        import xgboost as xgb

        with _open(path, "r") as f:
            data = json.load(f)
        saved, ours = data.get("features"), feature_schema()
        if saved is not None and saved != ours:
            raise ValueError(
                f"it was trained on {saved.get('columns')} feature columns (digest {saved.get('digest')}); this "
                f"version extracts {ours['columns']} (digest {ours['digest']}): retrain it "
                "(mlir-ansor export-dataset, train-model; the built-in one: scripts/pretrain_cost_model.py)"
            )
        self.config = XGBModelConfig(**data["config"])
        self.seed = data["seed"]
        self.booster = None
        self.base_model = None
        if data["booster"] is not None:
            self.base_model = data["booster"].encode()
            self.booster = xgb.Booster()
            self.booster.load_model(bytearray(self.base_model))


def feature_schema() -> dict:
    """The feature columns a saved model was trained on: their number and a
    digest of their names (`search.features.FEATURE_NAMES`)."""
    from mlir_ansor.search.features import FEATURE_NAMES

    digest = hashlib.sha256("\n".join(FEATURE_NAMES).encode()).hexdigest()[:16]
    return {"columns": len(FEATURE_NAMES), "digest": digest}


def _open(path: str | os.PathLike, mode: str):
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _pack(batch: Sequence[Features]) -> tuple[np.ndarray, np.ndarray]:
    """All statement rows stacked, and the program index of each row."""
    rows = np.concatenate([np.asarray(f, float).reshape(-1, np.asarray(f).shape[-1]) for f in batch], axis=0)
    ids = np.concatenate([np.full(len(np.asarray(f).reshape(-1, np.asarray(f).shape[-1])), i) for i, f in enumerate(batch)])
    return rows, ids.astype(np.int64)
