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
    if kind == "adagrad" and optimizer_offloaded(ds_config):
        return "cpu_adagrad"
    if kind in ("lion", "muon"):
        return kind
    return None


def optimizer_offloaded(ds_config: dict[str, Any]) -> bool:
    """The optimizer offloaded to CPU or NVMe (the engine's ``zero_use_cpu_optimizer``), where
    DeepSpeed builds its CPU optimizers."""
    zero = ds_config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")


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


# DeepSpeed's own Adams' group keys in the order their __init__ makes them (0.19.8): FusedAdam
# (ops/adam/fused_adam.py:89) and DeepSpeedCPUAdam (ops/adam/cpu_adam.py:66-71), with their defaults
_FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_CPU_ADAM_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0,
    "bias_correction": True,
    "amsgrad": False,
}
# the config keys DeepSpeed's engine takes out of the optimizer's params before building it
# (engine._configure_basic_optimizer, get_optimizer_configuration)
_ENGINE_KEYS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
# DeepSpeed's other own optimizers' group keys, in the order their __init__ makes them, with their
# defaults (0.19.8; runtime/engine.py:2495-2511 builds them from the config's params): the
# __init__ arguments that are not group keys (fp32_optimizer_states, eps_inside_sqrt, amsgrad of
# FusedLamb, set_grad_none) are taken and dropped
_DS_OWN_DEFAULTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    # ops/lion/cpu_lion.py:15,38 (DeepSpeedCPULion, the optimizer offloaded)
    "cpu_lion": ({"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0}, ("fp32_optimizer_states",)),
    # ops/lion/fused_lion.py:36-38 (FusedLion); its step keeps group['step'] too (:77-78)
    "fused_lion": ({"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}, ("set_grad_none",)),
    # ops/adagrad/cpu_adagrad.py:14-16 (DeepSpeedCPUAdagrad, the optimizer offloaded)
    "cpu_adagrad": (
        {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0, "amsgrad": False},
        ("fp32_optimizer_states",),
    ),
    # ops/lamb/fused_lamb.py:41-65 (FusedLamb)
    "fused_lamb": (
        {
            "lr": 1e-3,
            "bias_correction": True,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "max_grad_norm": 0.0,
            "max_coeff": 10.0,
            "min_coeff": 0.01,
        },
        ("eps_inside_sqrt", "amsgrad"),
    ),
}


def engine_param_group(ds_config: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The hyperparameters of a param group of the optimizer DeepSpeed's engine built from the
    config's ``optimizer`` section (0.19.8, ``_configure_basic_optimizer``, runtime/engine.py:2476-2548)
    where the training script gave its groups no values of their own, and the optimizer's name;
    (None, why) where zckpt cannot tell them: a client's optimizer (no ``optimizer`` section),
    DeepSpeed's Muon (each group split into a Muon and an Adam half, engine.py:2425-2474: one
    group per half, :func:`muon_param_groups`) and the MuP optimizers (the ``mup`` package's). torch's optimizers (type Adam/AdamW with
    ``torch_adam``, Adagrad not offloaded, any other ``torch.optim`` class by name) are built on
    a stand-in param, as the engine builds them; FusedAdam, DeepSpeedCPUAdam, FusedLion,
    DeepSpeedCPULion, DeepSpeedCPUAdagrad and FusedLamb from their ``__init__``'s defaults
    (``_DS_OWN_DEFAULTS``). Used where a checkpoint saves no param groups (elastic_checkpoint)."""
    section = ds_config.get("optimizer")
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return None, "the run's optimizer is the training script's own (the config has no optimizer section)"
    kind = section["type"]
    if not isinstance(section.get("params") or {}, dict):
        return None, f"the config's optimizer params are a {type(section['params']).__name__}"
    params = dict(section.get("params") or {})
    lower = kind.lower()
    offloaded = optimizer_offloaded(ds_config)
    if lower in ADAM_TYPES:
        adam_w_mode = lower == "adamw" or bool(params.get("adam_w_mode", True))
        torch_adam = bool(params.get("torch_adam", False))
        kwargs = {k: v for k, v in params.items() if k not in _ENGINE_KEYS}
        if torch_adam:
            import torch

            return _named(_torch_group(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, kwargs), kind)
        defaults = _CPU_ADAM_DEFAULTS if offloaded else _FUSED_ADAM_DEFAULTS
        unknown = [k for k in kwargs if k not in defaults]
        if unknown:
            return None, f"the config's Adam params {unknown} are not DeepSpeed's Adam's"
        return {k: kwargs.get(k, v) for k, v in defaults.items()}, kind
    if lower == "adagrad" and not offloaded:
        import torch

        return _named(_torch_group(torch.optim.Adagrad, params), kind)
    own = {"lamb": "fused_lamb", "lion": "cpu_lion" if offloaded else "fused_lion", "adagrad": "cpu_adagrad"}.get(lower)
    if own is not None:
        defaults, init_only = _DS_OWN_DEFAULTS[own]
        kwargs = {k: v for k, v in params.items() if k not in init_only}
        unknown = [k for k in kwargs if k not in defaults]
        if unknown:  # the engine would have failed to build it with these
            return None, f"the config's {kind} params {unknown} are not DeepSpeed's {kind}'s"
        return {k: kwargs.get(k, v) for k, v in defaults.items()}, kind
    if lower == "muon":
        return (
            None,
            f"DeepSpeed built its {kind} optimizer, whose Muon and Adam halves are the config's only where the "
            "training script passed one group (muon_param_groups; here several groups, MoE, or a half never stepped)",
        )
    if lower in ("muadam", "muadamw", "musgd"):
        return (
            None,
            f"DeepSpeed built its {kind} optimizer, whose groups it makes per param (not from the config alone)",
        )
    import torch

    optimizer = getattr(torch.optim, kind, None)
    if not isinstance(optimizer, type):
        return None, f"the config's optimizer type {kind!r} is not one zckpt knows"
    return _named(_torch_group(optimizer, params), kind)


def _named(group: dict[str, Any] | None, kind: str) -> tuple[dict[str, Any] | None, str]:
    return (group, kind) if group is not None else (None, f"torch's {kind} refuses the config's params")


def _torch_group(optimizer: Any, params: dict[str, Any]) -> dict[str, Any] | None:
    import torch

    try:
        group = optimizer([torch.zeros(1)], **params).param_groups[0]
    except (TypeError, ValueError):  # params torch's optimizer refuses: the engine would have too
        return None
    return {k: v for k, v in group.items() if k != "params"}


# MuonWithAuxAdam.__init__'s defaults for each half (runtime/zero/muon/original_muon.py:381-396),
# set as ``group[k] = group.get(k, default)`` in this order
_MUON_HALF_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0, "ns_method": "gram"}
_MUON_ADAM_HALF_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0}
# engine._MUON_HALF_KEYS / _ADAM_HALF_KEYS (runtime/engine.py:2412-2413): the config keys each half takes
_MUON_HALF_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_HALF_KEYS = ("lr", "betas", "eps", "weight_decay")


def muon_param_groups(
    ds_config: dict[str, Any], halves: list[bool], stepped: list[bool]
) -> tuple[list[dict[str, Any]] | None, str]:
    """Each flat group's hyperparameters as DeepSpeed's engine built them for its Muon optimizer
    from the config alone (0.19.8: ``_muon_param_groups``, runtime/engine.py:2425-2474, the Muon
    branch of ``_configure_basic_optimizer``, :2530-2546, ``MuonWithAuxAdam.__init__``,
    runtime/zero/muon/muon_optimizer.py:18-41 and original_muon.py:376-397), where the training
    script passed one group of its own values (``model.parameters()``): `halves` says which flat
    group is the Muon half (``use_muon``), `stepped` which has been stepped. Its ``[Muon, Adam]``
    halves are named ``muon-params`` / ``adam-params`` and take the config's lr (``muon_lr`` /
    ``adam_lr`` over it) and their own keys, then MuonWithAuxAdam's defaults; the Adam half then
    the defaults of the Adam built for it (FusedAdam, DeepSpeedCPUAdam offloaded, torch's with
    ``torch_adam``), and FusedAdam's ``step: 0`` once stepped (ops/adam/fused_adam.py:132-133).
    (None, why) where the flat groups are not one group's halves (several script groups, MoE:
    their names and values are the script's) or the config is not one the engine builds."""
    section = ds_config.get("optimizer")
    params = section.get("params") if isinstance(section, dict) else None
    if not isinstance(params or {}, dict):
        return None, f"the config's optimizer params are a {type(params).__name__}"
    if halves not in ([True, False], [True], [False]):
        return None, (
            f"its {len(halves)} flat groups are not the Muon and Adam halves of one group: the training script "
            "(or MoE) made several, whose names and values the files do not keep"
        )
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("zenflow"):
        return None, "a ZenFlow run's Muon (its Adam is ZenFlowCPUAdam)"
    params = dict(params or {})
    params.pop("adam_w_mode", None)
    adam_w_mode = bool((section.get("params") or {}).get("adam_w_mode", True))
    torch_adam = bool(params.pop("torch_adam", False))  # engine.get_optimizer_configuration, :2374-2378
    params.pop("fp32_optimizer_states", None)
    foreach = params.pop("foreach", None) if torch_adam else None
    groups: list[dict[str, Any]] = []
    for use_muon, was_stepped in zip(halves, stepped):
        keys, override = (_MUON_HALF_KEYS, "muon_lr") if use_muon else (_ADAM_HALF_KEYS, "adam_lr")
        group: dict[str, Any] = {"use_muon": use_muon, "name": "muon-params" if use_muon else "adam-params"}
        group.update({k: params[k] for k in keys if k in params})
        if override in params:
            group["lr"] = params[override]
        for key, default in (_MUON_HALF_DEFAULTS if use_muon else _MUON_ADAM_HALF_DEFAULTS).items():
            group[key] = group.get(key, default)
        if not use_muon:
            if torch_adam:
                import torch

                built = _torch_group_of(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, group, foreach)
                if built is None:
                    return None, "torch's Adam refuses the config's Adam half"
                group = built
            else:
                for key, default in (
                    _CPU_ADAM_DEFAULTS if optimizer_offloaded(ds_config) else _FUSED_ADAM_DEFAULTS
                ).items():
                    group.setdefault(key, default)
                if was_stepped and not optimizer_offloaded(ds_config):
                    group["step"] = 0
        groups.append(group)
    return groups, "Muon"


def _torch_group_of(optimizer: Any, group: dict[str, Any], foreach: Any) -> dict[str, Any] | None:
    """`group` as torch's `optimizer` completes it (its defaults after the group's own keys)."""
    import torch

    try:
        built = optimizer([{**group, "params": [torch.zeros(1)]}], foreach=foreach).param_groups[0]
    except (TypeError, ValueError):
        return None
    return {k: v for k, v in built.items() if k != "params"}
