"""Cost models: predict which candidates of a task run fastest.

`base.py` holds the interface (:class:`CostModel`) and the ranking metric;
`xgb_model.py` the learned model (XGBoost over the statement features of
`search/features/`); `random_model.py` the baseline that knows nothing.
"""

from mlir_ansor.search.cost_model.base import CostModel, pairwise_accuracy
from mlir_ansor.search.cost_model.random_model import RandomModel
from mlir_ansor.search.cost_model.xgb_model import XGBModel, XGBModelConfig

__all__ = ["CostModel", "RandomModel", "XGBModel", "XGBModelConfig", "pairwise_accuracy"]
