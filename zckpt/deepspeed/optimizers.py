"""Which optimizer a DeepSpeed run built from its config's ``optimizer`` section (0.19.8,
``engine._configure_basic_optimizer`` / ``get_optimizer_configuration``): what a writer of another
framework's optimizer state needs to know that the saved param groups do not say."""

from __future__ import annotations

from typing import Any

ADAM_TYPES = ("adam", "adamw")  # runtime/config.py ADAM_OPTIMIZER, ADAMW_OPTIMIZER (names lower-cased)


def deepspeed_adam_w_mode(ds_config: dict[str, Any]) -> bool | None:
    """For a run whose config made DeepSpeed build its own Adam (FusedAdam; DeepSpeedCPUAdam with
    the optimizer offloaded), whether weight decay was decoupled (AdamW): always for type AdamW,
    for type Adam unless ``adam_w_mode`` is false. None for any other optimizer, for torch's own
    (``torch_adam``), and for a client's optimizer (no ``optimizer`` section): their groups say
    what they are. Those two Adams save only lr, betas, eps, weight_decay, bias_correction (and
    amsgrad) per group."""
    section = ds_config.get("optimizer")
    if not isinstance(section, dict):
        return None
    params = section.get("params") or {}
    kind = str(section.get("type", "")).lower()
    if kind not in ADAM_TYPES or not isinstance(params, dict) or params.get("torch_adam"):
        return None
    return kind == "adamw" or bool(params.get("adam_w_mode", True))


def deepspeed_own_optimizer(ds_config: dict[str, Any]) -> str | None:
    """Which of DeepSpeed's own optimizers the config's ``optimizer`` section made the engine build
    (0.19.8, ``_configure_basic_optimizer``): ``"adam"`` (FusedAdam; DeepSpeedCPUAdam with the
    optimizer offloaded: :func:`deepspeed_adam_w_mode` says which weight decay), ``"cpu_adagrad"``
    (type Adagrad with the optimizer offloaded to CPU or NVMe: DeepSpeedCPUAdagrad; torch's Adagrad
    otherwise), ``"lion"`` (DeepSpeedCPULion offloaded, FusedLion otherwise), ``"muon"``
    (MuonWithAuxAdam: a Muon half and an Adam half per group, ``use_muon`` in each). None: torch's
    own (its groups and states are torch's already) or a client's optimizer."""
    section = ds_config.get("optimizer")
    if not isinstance(section, dict):
        return None
    kind = str(section.get("type", "")).lower()
    if deepspeed_adam_w_mode(ds_config) is not None:
        return "adam"
    zero = ds_config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    offloaded = isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")  # zero_use_cpu_optimizer
    if kind == "adagrad" and offloaded:
        return "cpu_adagrad"
    if kind in ("lion", "muon"):
        return kind
    return None


def muon_adam_w_mode(ds_config: dict[str, Any]) -> bool:
    """Whether a Muon run's Adam half decoupled its weight decay: the config's ``adam_w_mode``
    (default true), as MuonWithAuxAdam and its FusedAdam take it."""
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    return bool(params.get("adam_w_mode", True)) if isinstance(params, dict) else True


# The order in which torch's optimizers (2.x, ``_init_group``) and DeepSpeed's create a param's
# state keys, merged into one order that each optimizer's own keys follow: Adam/AdamW/RAdam step,
# exp_avg, exp_avg_sq, max_exp_avg_sq; NAdam step, mu_product, exp_avg, exp_avg_sq; RMSprop step,
# square_avg, momentum_buffer, grad_avg; Adadelta step, square_avg, acc_delta; Adamax step,
# exp_avg, exp_inf; Adagrad step, sum; ASGD step, eta, mu, ax; Rprop step, prev, step_size; SGD
# and Muon momentum_buffer; DeepSpeed's CPU Adagrad exp_avg_sq, CPU Lion exp_avg, exp_avg_sq.
STATE_CREATION_ORDER = (
    "step",
    "mu_product",
    "eta",
    "mu",
    "ax",
    "square_avg",
    "acc_delta",
    "momentum_buffer",
    "grad_avg",
    "prev",
    "step_size",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "exp_inf",
    "sum",
)
_RANK = {name: index for index, name in enumerate(STATE_CREATION_ORDER)}


def in_creation_order(names: list[str]) -> list[str]:
    """`names` (a param's optimizer-state keys, found in no particular order: a universal folder
    keeps one file per state) in the order its optimizer created them, as torch.save then
    pickled them; names no known optimizer creates come last, by name.

    >>> in_creation_order(["grad_avg", "momentum_buffer", "square_avg"])
    ['square_avg', 'momentum_buffer', 'grad_avg']
    """
    return sorted(names, key=lambda name: (_RANK.get(name, len(_RANK)), name))
