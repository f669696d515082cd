"""What the reader relies on in the pickles it reads: the type of each key of the model-states
and optimizer-states files (a value of another type is a damaged or edited file, reported as
such instead of failing later on a missing attribute), and shapes as plain integers.
"""

from __future__ import annotations

import math
from typing import Any

from ..core.index import TensorRef
from . import names as N


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(map(_is_count, value))


def _is_shape_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_shape(v) for k, v in value.items())


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, TensorRef) for t in value)


# What the reader relies on in each key it reads: (expected, test). A value of another type is a
# damaged or edited file, reported as such instead of failing later on a missing attribute.
Schema = dict[str, tuple[str, Any]]
MODEL_SCHEMA: Schema = {
    N.MODULE: ("a dict of tensors", lambda v: isinstance(v, dict)),
    N.PARAM_SHAPES: (
        "a list of {name: shape} dicts",
        lambda v: _is_shape_map(v) or (isinstance(v, (list, tuple)) and all(map(_is_shape_map, v))),
    ),
    N.BUFFER_NAMES: (
        "a list of names",
        lambda v: v is None or (isinstance(v, (list, tuple, set)) and all(isinstance(n, str) for n in v)),
    ),
    N.FROZEN_PARAM_SHAPES: ("a {name: shape} dict", lambda v: v is None or _is_shape_map(v)),
    N.FROZEN_PARAM_FRAGMENTS: ("a {name: tensor} dict", lambda v: v is None or isinstance(v, dict)),
    N.SHARED_PARAMS: (
        "an {alias: name} dict",
        lambda v: (
            v is None or (isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()))
        ),
    ),
    N.DS_CONFIG: ("a dict", lambda v: v is None or isinstance(v, dict)),
    N.DP_WORLD_SIZE: ("an integer", lambda v: v is None or _is_count(v)),
    N.MP_WORLD_SIZE: ("an integer", lambda v: v is None or _is_count(v)),
}
OPTIM_SCHEMA: Schema = {
    N.FP32_FLAT_GROUPS: ("a list of tensors", _is_tensor_list),
    N.SINGLE_PARTITION_OF_FP32_GROUPS: ("a list of tensors", _is_tensor_list),
    N.PARTITION_COUNT: (
        "an integer or a list of them",
        lambda v: v is None or _is_count(v) or (isinstance(v, (list, tuple)) and bool(v) and all(map(_is_count, v))),
    ),
    N.ZERO_STAGE: ("an integer", lambda v: v is None or _is_count(v)),
    N.PARAM_ALIGNMENT_PADDINGS: (
        "a list of lists of integers",
        lambda v: v is None or (isinstance(v, (list, tuple)) and all(_is_shape(p) for p in v)),
    ),
}


def schema_problems(state: dict, schema: Schema) -> list[str]:
    """The keys of `state` whose values are not of the type DeepSpeed writes. Guarantee: DeepSpeed
    writes them so (``_common_checkpoint_state``, deepspeed/runtime/engine.py:5017-5038; ZeRO
    ``state_dict``, zero/stage_1_and_2.py:3358-3397, zero/stage3.py:3431-3447; ``ds_config``
    always a dict, a path being loaded first, deepspeed/__init__.py:534-535)."""
    return [
        f"'{key}' is {type(state[key]).__name__}, expected {expected}: not as DeepSpeed writes it (damaged or edited)"
        for key, (expected, test) in schema.items()
        if key in state and not test(state[key])
    ]


def sound(state: Any, key: str, schema: Schema) -> bool:
    """A readable state dict holding `key`, with every key of `schema` as DeepSpeed writes it."""
    return isinstance(state, dict) and state.get(key) is not None and not schema_problems(state, schema)


def numel_of(shape: Any) -> int:
    return math.prod(shape)


def as_shape(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)
