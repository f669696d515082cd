"""The whole training state read from the samples equals what the live DeepSpeed engine held:
optimizer states per param (safe_get_full_optimizer_state before saving), steps, counters."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from helpers import SAMPLE_LIST, Sample, same_bits
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader

WITH_LIVE_OPTIMIZER = [s for s in SAMPLE_LIST if (s.folder / "reference" / "live_optimizer.safetensors").exists()]


@pytest.mark.parametrize("case", WITH_LIVE_OPTIMIZER, ids=lambda s: s.name)
def test_optimizer_states_equal_the_live_engine(case: Sample) -> None:
    live = load_file(case.folder / "reference" / "live_optimizer.safetensors")
    state = open_training_state(case.checkpoint)
    checked = 0
    with FileReader() as reader:
        for param in state.params:
            for key, source in param.states.items():
                expected = live.get(f"{param.name}.{key}")
                if expected is None:
                    continue
                assert same_bits(read_tensor(reader, source), expected), (param.name, key)
                checked += 1
    assert checked == len(
        [k for k in live if not any(k == f"{a}.{s}" for a in case.meta.get("tied", {}) for s in case.state_names)]
    )


@pytest.mark.parametrize("case", SAMPLE_LIST, ids=lambda s: s.name)
def test_counters_and_steps_match_the_run(case: Sample) -> None:
    state = open_training_state(case.checkpoint)
    steps = max(case.meta["steps"]) if isinstance(case.meta["steps"], list) else case.meta["steps"]
    # ZenFlow: a global step every update_interval micro-steps, the CPU Adam's step the micro-steps
    # (ZenFlowZeroOptimizerSequential steps it with step_id=micro_step + 1)
    assert state.global_steps == (steps // case.zenflow["update_interval"] if case.zenflow else steps)
    assert state.skipped_steps == case.meta.get("skipped_steps", 0)
    assert len(state.groups) == case.meta["param_groups"]
    assert state.state_names == case.state_names
    with FileReader() as reader:
        for group in state.groups if case.counts_steps else ():
            saved = group.scalars["step"]  # DeepSpeed's own optimizers keep a Python int
            step = saved.value if saved.tensor is None else read_tensor(reader, saved.tensor).item()
            assert step == steps - state.skipped_steps
    trainable = {p.name for p in state.params}
    frozen = set(case.meta["frozen"])
    assert not trainable & frozen
    assert trainable | frozen | set(case.meta["tied"]) | set(case.meta["buffers"]) == set(state.module_names)


def test_round_robin_input_gives_the_optimizer_order() -> None:
    """With round_robin_gradients the flat buffers hold a reordering; the state lists params in
    the order of the user's param group (here: model.parameters() order, as the module has it)."""
    case = next(s for s in SAMPLE_LIST if s.name == "z1_fp32_ws2_roundrobin")
    state = open_training_state(case.checkpoint)
    assert state.round_robin
    module_params = [n for n in state.module_names if n in {p.name for p in state.params}]
    assert [p.name for p in state.params] == module_params
