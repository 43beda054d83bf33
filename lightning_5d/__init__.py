"""lightning_5d: 5D parallel training for existing LightningModules.

``import lightning_5d`` registers ``Trainer(strategy="5d")``.
"""

__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry

from lightning_5d.config import (
    ActivationCheckpointing,
    Layout,
    LayoutError,
    ParallelConfig,
    ZeroStage,
)
from lightning_5d.fp8.recipes import Fp8Backend, Fp8Recipe
from lightning_5d.grad_norms import grad_norm
from lightning_5d.gradient_reads import GradientReadError
from lightning_5d.parallel.token_mean import TokenMeanError
from lightning_5d.parameter_reads import ParameterReadError
from lightning_5d.precision import FiveDPrecision, PrecisionError
from lightning_5d.requeue import AutoRequeue
from lightning_5d.strategy import FiveDStrategy

if FiveDStrategy.strategy_name not in StrategyRegistry:
    FiveDStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ActivationCheckpointing",
    "AutoRequeue",
    "FiveDPrecision",
    "FiveDStrategy",
    "Fp8Backend",
    "Fp8Recipe",
    "GradientReadError",
    "Layout",
    "LayoutError",
    "ParallelConfig",
    "ParameterReadError",
    "PrecisionError",
    "TokenMeanError",
    "ZeroStage",
    "__version__",
    "grad_norm",
]
