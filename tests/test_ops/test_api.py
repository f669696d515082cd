"""The Python API: state dicts in memory, lazily, and straight into a module."""

from __future__ import annotations

import pytest
import torch

import zckpt
from helpers import Sample, same_bits, sample
from zckpt import LayoutError

CASE = "z3_fp32_ws2_tied_frozen"


def module_for(state: dict[str, torch.Tensor], tied: dict[str, str]) -> torch.nn.Module:
    """A module whose state_dict has exactly these names and shapes (tied names share a param)."""
    root = torch.nn.Module()
    made: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if name in tied:
            value = made[tied[name]]
        elif tensor.is_floating_point():
            value = torch.nn.Parameter(torch.zeros_like(tensor))
        else:
            owner.register_buffer(leaf, torch.zeros_like(tensor))
            continue
        owner.register_parameter(leaf, value) if isinstance(value, torch.nn.Parameter) else None
        made[name] = value
    return root


def test_load_state_dict_equals_expected(any_sample: Sample) -> None:
    ours = zckpt.load_state_dict(any_sample.checkpoint)
    for name, tensor in any_sample.expected_fp32().items():
        assert same_bits(ours[name], tensor), name
    for alias, source in any_sample.meta["tied"].items():
        assert ours[alias] is ours[source]


def test_iter_tensors_is_lazy_and_ordered_like_load_state_dict() -> None:
    case = sample(CASE)
    stream = zckpt.iter_tensors(case.checkpoint, dtype="bf16")
    first_name, first = next(stream)
    whole = zckpt.load_state_dict(case.checkpoint, dtype="bf16")
    assert first_name == next(iter(whole))
    rest = dict([(first_name, first), *stream])
    assert list(rest) == list(whole)
    assert all(same_bits(rest[n], whole[n]) for n in whole)
    assert {t.dtype for t in rest.values() if t.is_floating_point()} == {torch.bfloat16}


def test_load_into_module_copies_every_tensor() -> None:
    case = sample(CASE)
    reference = case.reference()
    model = module_for(reference, case.meta["tied"])
    missing, unexpected = zckpt.load_into_module(model, case.checkpoint)
    assert (missing, unexpected) == ([], [])
    state = model.state_dict()
    for name, tensor in reference.items():
        assert same_bits(state[name], tensor), name


def test_load_into_module_is_strict_about_keys() -> None:
    case = sample(CASE)
    reference = case.reference()
    model = module_for(reference, case.meta["tied"])
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(LayoutError, match="missing from the checkpoint: extra"):
        zckpt.load_into_module(model, case.checkpoint)
    missing, unexpected = zckpt.load_into_module(model, case.checkpoint, strict=False)
    assert missing == ["extra"] and unexpected == []

    smaller = module_for({k: v for k, v in reference.items() if k != "norm.bias"}, case.meta["tied"])
    with pytest.raises(LayoutError, match="not in the module: norm.bias"):
        zckpt.load_into_module(smaller, case.checkpoint)


def test_load_into_module_rejects_shape_mismatch() -> None:
    case = sample(CASE)
    reference = dict(case.reference())
    reference["norm.bias"] = torch.zeros(3)
    with pytest.raises(LayoutError, match="norm.bias"):
        zckpt.load_into_module(module_for(reference, case.meta["tied"]), case.checkpoint)


def test_bad_dtype_is_a_usage_error() -> None:
    with pytest.raises(zckpt.UsageError, match="fp8"):
        zckpt.load_state_dict(sample(CASE).checkpoint, dtype="fp8")
