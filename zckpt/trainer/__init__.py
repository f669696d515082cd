"""``zckpt train``: a small ZeRO-3 trainer on torch.distributed that writes DeepSpeed's layout.

The model (:func:`build_model`), the partitioning (:mod:`.zero3`, on the format layer's layout),
the sharded AdamW (:mod:`.optim`), the data (:mod:`.data`), the loop (:mod:`.loop`) and the
checkpoints (:mod:`.checkpoint`, through the shared DeepSpeed writer) are one module each.
"""

from .config import TrainConfig
from .loop import StepLog, Trainer, TrainResult, train
from .model import GPT, GPTConfig, build_model
from .resume import TrainPlan, plan_training

__all__ = [
    "GPT",
    "GPTConfig",
    "StepLog",
    "TrainConfig",
    "TrainPlan",
    "TrainResult",
    "Trainer",
    "build_model",
    "plan_training",
    "train",
]
