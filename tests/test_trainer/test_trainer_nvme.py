"""NVMe offload in the trainer: training with the optimizer state of the big sub-groups in
DeepSpeed's swap files is bit for bit training in memory; zckpt's own reader of DeepSpeed's live
swap folder reads the trainer's masters back; checkpoints carry offloaded_tensors/ and resume
bit for bit; the swapped state takes the buffer pool's memory, not the model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from zckpt.deepspeed.reader import open_training_state
from zckpt.ops import api
from zckpt.torchfile import reader as torchfile
from zckpt.trainer import TrainConfig, Trainer
from zckpt.trainer.ranks import run_ranks

KEYS = ("master", "exp_avg", "exp_avg_sq")
# sub-groups of 530000 elements: per rank >= 1 MiB of fp32 (swapped) and a small one that stays in
# memory; at one rank two swapped sub-groups (the step streams them), at two ranks one
OPTIONS = dict(
    layers=1,
    dim=256,
    heads=4,
    vocab=256,
    seq_len=16,
    micro_batch=2,
    lr=1e-3,
    warmup=1,
    steps=4,
    seed=3,
    tie_embeddings=True,
    sub_group_size=530000,
)


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        f"{spec.name}.{key}": trainer.optimizer.full_state(index, key).clone()
        for index, spec in enumerate(trainer.plan.params)
        if spec.trainable
        for key in KEYS
    }


def _swapped_names(trainer: Trainer) -> list[str]:
    layout = trainer.plan.layout
    return [layout.params[i].name for f in sorted(trainer.optimizer.swapped) for i in layout.flat_groups[f].params]


def _runs(rank: int, world: int, folder: str, dtype: str) -> dict:
    """In memory and with NVMe side by side; the NVMe run saves at step 2; a third run resumes
    from that checkpoint (with NVMe, another swap folder) and goes on."""
    config = TrainConfig(**{**OPTIONS, "dtype": dtype})
    memory = Trainer(config)
    nvme = Trainer(replace(config, nvme_path=f"{folder}/nvme", out=f"{folder}/ckpt"))
    out: dict = {
        "memory_losses": [],
        "nvme_losses": [],
        "swapped": _swapped_names(nvme),
        "pool": nvme.optimizer.swapper.pool_bytes,
    }
    for _ in range(config.steps):
        out["memory_losses"].append(memory.train_step().loss)
        out["nvme_losses"].append(nvme.train_step().loss)
        if nvme.global_steps == 2:
            nvme.save()
            out["saved"] = _state(nvme)
    out["memory_final"], out["nvme_final"] = _state(memory), _state(nvme)
    out["counters"] = vars(nvme.optimizer.swapper.counters)
    out["direct"] = nvme.optimizer.swapper.direct
    resumed = Trainer(replace(config, nvme_path=f"{folder}/nvme_resumed", resume=f"{folder}/ckpt"))
    out["resumed_loaded"] = _state(resumed)
    out["resumed_losses"] = [resumed.train_step().loss for _ in range(config.steps - 2)]
    out["resumed_final"] = _state(resumed)
    for trainer in (memory, nvme, resumed):
        trainer.close()
    return out


@pytest.fixture(scope="module", params=[(1, "fp32"), (2, "bf16")], ids=["1rank-fp32", "2ranks-bf16"])
def runs(request, tmp_path_factory):
    world, dtype = request.param
    folder = tmp_path_factory.mktemp(f"nvme{world}")
    result = run_ranks(world, folder / "ranks", _runs, str(folder), dtype)[0]
    return world, folder, result


@pytest.mark.slow
def test_nvme_training_is_in_memory_training_bit_for_bit(runs):
    world, _, result = runs
    assert result["swapped"] and result["counters"]["bytes_read"] > 0 and result["counters"]["bytes_written"] > 0
    assert result["nvme_losses"] == result["memory_losses"]
    assert result["nvme_final"].keys() == result["memory_final"].keys()
    assert all(torch.equal(result["nvme_final"][n], t) for n, t in result["memory_final"].items())


@pytest.mark.slow
def test_live_swap_folder_is_deepspeeds_layout(runs):
    world, folder, result = runs
    for rank in range(world):
        live = sorted(os.listdir(folder / "nvme" / "zero_stage_3" / "optimizer" / f"rank{rank}"))
        saved = sorted(os.listdir(folder / "ckpt" / "global_step2" / "offloaded_tensors" / f"rank{rank:02d}"))
        gradients = [name for name in live if "_gradient_" in name]  # live only, as DeepSpeed's: never checkpointed
        assert sorted(set(live) - set(gradients)) == saved and len(saved) == 3 * (2 if world == 1 else 1)
        assert len(gradients) == len(saved) // 3
        for (
            name
        ) in gradients:  # <first>_<last>_gradient_0_<numel>: the sub-group's master file's id, its whole partition
            swap_id, numel = name.split("_gradient_0_")[0], int(name.split("_gradient_0_")[1].split(".")[0])
            assert (
                f"{swap_id}.tensor.swp" in saved
                and os.path.getsize(folder / "nvme" / "zero_stage_3" / "optimizer" / f"rank{rank}" / name) == 4 * numel
            )
    # zckpt's reader of DeepSpeed's live swap folders: the swapped sub-groups are the trainer's
    # masters and moments after its last step (the others come from the step-2 checkpoint)
    state = open_training_state(folder / "ckpt", swap_folder=folder / "nvme")
    weights = api.load_state_dict(folder / "ckpt", swap_folder=folder / "nvme")
    for name in result["swapped"]:
        assert torch.equal(weights[name], result["nvme_final"][f"{name}.master"]), name
    by_name = {p.name: p for p in state.params}
    assert set(result["swapped"]) <= set(by_name)


@pytest.mark.slow
def test_consolidate_cli_of_swap_folder(runs, tmp_path):
    _, folder, result = runs
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zckpt",
            "consolidate",
            str(folder / "ckpt"),
            str(tmp_path / "out"),
            "--swap-folder",
            str(folder / "nvme"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(weights[name], result["nvme_final"][f"{name}.master"]) for name in result["swapped"])


def test_checkpoint_has_offloaded_tensors_and_consolidates_to_the_masters(runs):
    world, folder, result = runs
    tag = folder / "ckpt" / "global_step2"
    optim = torchfile.load(
        sorted(tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))[0]
    )  # DeepSpeed's classes held by name
    assert optim["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    emptied = [t for t in optim["optimizer_state_dict"]["fp32_flat_groups"] if t.numel == 0]
    assert len(emptied) == (2 if world == 1 else 1)  # the swapped sub-groups' masters are in offloaded_tensors/
    weights = api.load_state_dict(folder / "ckpt")
    masters = {k[: -len(".master")]: v for k, v in result["saved"].items() if k.endswith(".master")}
    assert all(torch.equal(weights[n], t) for n, t in masters.items())


def test_resume_from_nvme_checkpoint_is_bit_identical(runs):
    _, _, result = runs
    assert all(torch.equal(result["resumed_loaded"][n], t) for n, t in result["saved"].items())
    assert result["resumed_losses"] == result["nvme_losses"][2:]
    assert all(torch.equal(result["resumed_final"][n], t) for n, t in result["nvme_final"].items())


_RESIDENT = """
import ctypes, json, os, sys
from zckpt.trainer import TrainConfig, Trainer
options = json.loads(sys.argv[1])
trainer = Trainer(TrainConfig(**options))
for _ in range(2):
    trainer.train_step()
ctypes.CDLL(None).malloc_trim(0)  # live memory: free heap pages back to the system first
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
swapper = trainer.optimizer.swapper
print(json.dumps({"resident": resident, "pool": swapper.pool_bytes if swapper else 0,
                  "swapped_state": sum(4 * (3 * g.file_numel + g.numel) for g in swapper.groups.values()) if swapper else 0}))
"""


@pytest.mark.heavy
@pytest.mark.slow
def test_swapped_state_takes_the_pool_not_the_model(tmp_path):
    """A model whose swapped optimizer state (masters, moments, gradients) is 10x the pool: after
    two steps the process holds less memory with NVMe than in memory by about that state less the pool (the same run in two
    fresh processes; the masters and moments in memory are resident, the swap files are not)."""
    options = dict(layers=14, dim=256, heads=4, vocab=256, seq_len=8, micro_batch=1, steps=2, sub_group_size=262144)
    runs = {}
    for mode, extra in (("memory", {}), ("nvme", {"nvme_path": str(tmp_path / "nvme")})):
        done = subprocess.run(
            [sys.executable, "-c", _RESIDENT, json.dumps({**options, **extra})],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr
        runs[mode] = json.loads(done.stdout)
    nvme = runs["nvme"]
    assert nvme["swapped_state"] >= 10 * nvme["pool"]
    spared = runs["memory"]["resident"] - nvme["resident"]
    assert spared >= 0.8 * (nvme["swapped_state"] - nvme["pool"]), (runs, spared)


@pytest.mark.slow
def test_cli_trains_with_nvme_path(tmp_path):
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    model = [
        "--layers",
        "1",
        "--dim",
        "256",
        "--heads",
        "4",
        "--vocab",
        "64",
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
        "--sub-group-size",
        "530000",
    ]
    result = CliRunner().invoke(
        app, ["train", "--out", str(tmp_path / "run"), "--steps", "2", "--nvme-path", str(tmp_path / "nvme"), *model]
    )
    assert result.exit_code == 0, result.output
    live = sorted(
        n for n in os.listdir(tmp_path / "nvme" / "zero_stage_3" / "optimizer" / "rank0") if "_gradient_" not in n
    )
    assert (
        f"NVMe offload: {len(live) // 3} of 3 optimizer sub-groups per rank in {tmp_path / 'nvme'}/zero_stage_3/optimizer/"
        in result.output
    )
    assert (
        live == sorted(os.listdir(tmp_path / "run" / "global_step2" / "offloaded_tensors" / "rank00"))
        and len(live) == 6
    )
    (tmp_path / "a_file").write_text("")
    bad = CliRunner().invoke(app, ["train", "--nvme-path", str(tmp_path / "a_file"), *model])
    assert bad.exit_code == 2 and "--nvme-path must be a folder" in bad.output
    bad = CliRunner().invoke(app, ["train", "--nvme-params", *model])
    assert bad.exit_code == 2 and "--nvme-params needs --nvme-path" in bad.output
    # the params too: those of 1 MiB of fp32 and more (the 4096 x 256 embedding and lm head, the
    # two 256 x 1024 MLP matrices) go to float32params/rank0/
    big = [*model[: model.index("--vocab")], "--vocab", "4096", *model[model.index("--vocab") + 2 :]]
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--out",
            str(tmp_path / "run2"),
            "--steps",
            "2",
            "--nvme-path",
            str(tmp_path / "nvme2"),
            "--nvme-params",
            "--bounded-memory",
            *big,
        ],
    )
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "params per rank" in line)
    assert line.startswith("NVMe offload: 4 of 17 params per rank in ") and line.split(" in ")[1].startswith(
        f"{tmp_path / 'nvme2'}/zero_stage_3/float32params/"
    ), line
    swapped = sorted(os.listdir(tmp_path / "nvme2" / "zero_stage_3" / "float32params" / "rank0"))
    assert len(swapped) == 4 and "0_param.tensor.swp" in swapped  # wte is ds_id 0


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize(
    "accumulation", [dict(), dict(grad_accum=3, clip=0.05, dtype="bf16")], ids=["plain", "grad-accum-clip-bf16"]
)
def test_many_sub_groups_stream_through_three_buffer_sets(tmp_path, accumulation):
    """More swapped sub-groups than buffer sets (the pool's buffers are reused while reads and
    writes are in flight): still in-memory training bit for bit; also with gradients accumulated
    in the swap files over three micro-steps and clipped by the global norm."""
    options = dict(
        layers=2,
        dim=256,
        heads=4,
        vocab=64,
        seq_len=8,
        micro_batch=2,
        steps=3,
        sub_group_size=262144,
        lr=1e-3,
        **accumulation,
    )
    memory = Trainer(TrainConfig(**options))
    nvme = Trainer(TrainConfig(**options, nvme_path=str(tmp_path)))
    assert len(nvme.optimizer.swapped) >= 6  # twice the buffer sets
    assert [memory.train_step().loss for _ in range(3)] == [nvme.train_step().loss for _ in range(3)]
    assert all(torch.equal(t, _state(nvme)[n]) for n, t in _state(memory).items())
    nvme.close()


def test_swapper_stream_writes_back_what_the_step_changed(tmp_path):
    """The swapper alone: files filled with known values, streamed with each sub-group changed in
    its buffers; the files then hold the changed values (numpy's arithmetic on the file bytes)."""
    import numpy as np

    from zckpt.trainer.swap import OptimizerSwapper, SwappedGroup

    sizes = [262144, 300000, 262400, 400000, 262144, 270000, 350000]
    groups = [SwappedGroup(f, n, -(-n // 256) * 256, 2 * f, 2 * f + 1) for f, n in enumerate(sizes)]
    swapper = OptimizerSwapper(str(tmp_path / "rank0"), groups)
    rng = np.random.default_rng(0)
    start = {(f, k): rng.standard_normal(n).astype(np.float32) for f, n in enumerate(sizes) for k in range(3)}
    for (f, k), values in start.items():
        swapper.write_range(f, k, 0, values)
    # gradients: two shares per sub-group, the first written then added to (a second micro-step)
    gradients, seen, rests = {}, [], []
    for f, n in enumerate(sizes):
        cut = n // 3
        first, again, rest = (rng.standard_normal(m).astype(np.float32) for m in (cut, cut, n - cut))
        swapper.put_gradient(f, 0, torch.from_numpy(first.copy()), accumulate=False)
        swapper.put_gradient(
            f, cut, torch.from_numpy(rest.copy()), accumulate=False, on_written=lambda t: seen.append(t.numpy().copy())
        )
        swapper.put_gradient(
            f, 0, torch.from_numpy(again.copy()), accumulate=True, on_written=lambda t: seen.append(t.numpy().copy())
        )
        gradients[f] = np.concatenate([first + again, rest])
        rests += [rest, first + again]
    swapper.drain_gradients()
    assert len(seen) == len(rests) and all(
        np.array_equal(a, b) for a, b in zip(seen, rests)
    )  # what each file range now holds
    for f, tensors in swapper.stream(list(range(len(sizes)))):
        *states, gradient = tensors
        assert np.array_equal(gradient.numpy(), gradients[f]), f
        gradient.zero_()  # not written back: the gradient file keeps the gradient
        for k, tensor in enumerate(states):
            assert np.array_equal(tensor.numpy(), start[(f, k)])
            tensor.mul_(k + 2).add_(f)
    for (f, k), values in start.items():
        assert np.array_equal(swapper.read_range(f, k, 0, sizes[f]), values * np.float32(k + 2) + np.float32(f)), (f, k)
        assert os.path.getsize(swapper.paths[f][k]) == groups[f].file_numel * 4
    for f, n in enumerate(sizes):
        path = swapper.gradient_paths[f]
        assert os.path.basename(path) == f"{2 * f}_{2 * f + 1}_gradient_0_{n}.tensor.swp"
        assert np.array_equal(np.fromfile(path, dtype=np.float32), gradients[f])
    assert swapper.pool_bytes == 12 * -(-max(g.file_numel for g in groups) * 4 // 4096) * 4096
    swapper.close()


# params of >= 1 MiB per rank in bf16 at two ranks: the embedding (4096 x 256) and the untied lm head (frozen)
PARAM_OPTIONS = dict(
    layers=1,
    dim=256,
    heads=4,
    vocab=4096,
    seq_len=16,
    micro_batch=2,
    lr=1e-3,
    warmup=1,
    steps=4,
    seed=5,
    dtype="bf16",
    freeze=r"^lm_head\.",
    sub_group_size=530000,
    grad_accum=2,
)


def _param_runs(rank: int, world: int, folder: str) -> dict:
    """In memory, and with params, masters, moments and gradients on NVMe, side by side; the NVMe
    run saves at step 2 and a third run (NVMe params too) resumes from that checkpoint."""
    import numpy as np

    config = TrainConfig(**PARAM_OPTIONS)
    memory = Trainer(config)
    nvme = Trainer(replace(config, nvme_path=f"{folder}/nvme", nvme_params=True, out=f"{folder}/ckpt"))
    store = nvme.model.store
    out: dict = {
        "memory_losses": [],
        "nvme_losses": [],
        "swapped_params": sorted(nvme.plan.params[i].name for i in store.swapped),
    }
    for _ in range(config.steps):
        out["memory_losses"].append(memory.train_step().loss)
        out["nvme_losses"].append(nvme.train_step().loss)
        if nvme.global_steps == 2:
            nvme.save()
    out["memory_final"], out["nvme_final"] = _state(memory), _state(nvme)
    # each swap file holds the share the in-memory run holds (raw bf16 bytes, read with numpy)
    out["files_match"] = {}
    for index in store.swapped:
        raw = np.fromfile(store.paths[index], dtype=np.uint16)[: store.shares[index]]
        out["files_match"][nvme.plan.params[index].name] = bool(
            np.array_equal(raw, memory.model.store.read(index).view(torch.uint16).numpy())
        )
    out["file_sizes"] = {os.path.basename(store.paths[i]): os.path.getsize(store.paths[i]) for i in store.swapped}
    resumed = Trainer(replace(config, nvme_path=f"{folder}/nvme_resumed", nvme_params=True, resume=f"{folder}/ckpt"))
    out["resumed_losses"] = [resumed.train_step().loss for _ in range(config.steps - 2)]
    out["resumed_final"] = _state(resumed)
    for trainer in (memory, nvme, resumed):
        trainer.close()
    return out


@pytest.fixture(scope="module")
def param_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nvme_params")
    return folder, run_ranks(2, folder / "ranks", _param_runs, str(folder))


@pytest.mark.heavy
@pytest.mark.slow
def test_nvme_params_train_as_in_memory_bit_for_bit(param_runs):
    """DeepSpeed's offload_param: the embedding (trainable) and the frozen lm head live in
    <dtype>params/rank<R>/<ds_id>_param.tensor.swp, padded to 512 bf16 elements; training and the
    resumed run equal in-memory training bit for bit, with gradient accumulation and clipping."""
    folder, results = param_runs
    for rank, result in enumerate(results):
        assert result["swapped_params"] == ["lm_head.weight", "wte.weight"]
        assert all(result["files_match"].values()), result["files_match"]
        assert result["nvme_losses"] == result["memory_losses"]
        assert all(torch.equal(result["nvme_final"][n], t) for n, t in result["memory_final"].items())
        assert result["resumed_losses"] == result["nvme_losses"][2:]
        assert all(torch.equal(result["resumed_final"][n], t) for n, t in result["nvme_final"].items())
        # 4096 x 256 / 2 ranks = 524288 bf16 elements = 1 MiB: at the threshold, already aligned
        assert (
            sorted(result["file_sizes"].values()) == [1 << 20, 1 << 20] and "0_param.tensor.swp" in result["file_sizes"]
        )  # wte: ds_id 0
        assert sorted(os.listdir(folder / "nvme" / "zero_stage_3" / "bfloat16params" / f"rank{rank}")) == sorted(
            result["file_sizes"]
        )


@pytest.mark.heavy
@pytest.mark.slow
def test_swap_folder_reader_finds_the_params_current(param_runs):
    """zckpt's reader of DeepSpeed's live swap folders compares the 16-bit param swaps with the
    masters: the trainer's swaps hold the masters rounded (DeepSpeed's lag until an eviction)."""
    folder, results = param_runs
    state = open_training_state(folder / "ckpt", swap_folder=folder / "nvme")
    notes = state.index.notes
    # the trainable embedding (the frozen lm head has no master to compare with)
    assert "16-bit param swaps of 1 param(s) (1048576 elements) equal the fp32 masters rounded to bfloat16" in notes, (
        notes
    )


_GROWTH = """
import ctypes, json, os, sys
from zckpt.trainer import TrainConfig, Trainer
trainer = Trainer(TrainConfig(**json.loads(sys.argv[1])))
for _ in range(2):
    trainer.train_step()
ctypes.CDLL(None).malloc_trim(0)  # live memory: free heap pages back to the system first
plan = trainer.plan
print(json.dumps({"resident": int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
                  "state": sum(s.share for s in plan.params) * 4 + sum(g.partition for g in plan.layout.flat_groups) * 16,
                  "swapped_params": len(trainer.model.store.swapped)}))
"""


@pytest.mark.heavy
@pytest.mark.slow
def test_memory_does_not_grow_with_depth_under_nvme_params(tmp_path):
    """1 and 5 layers of width 512 (the largest param and the buffer pool the same): in memory
    the process grows by about the added model state (shares, masters, moments, gradients:
    ~240 MiB); with --nvme-path --nvme-params --bounded-memory by a small part of it (activations, the small
    params DeepSpeed's rule keeps in memory)."""
    options = dict(dim=512, heads=4, vocab=256, seq_len=16, micro_batch=1, steps=2, sub_group_size=300000)
    runs = {}
    for mode, extra in (("memory", {}), ("nvme", {"nvme_params": True, "bounded_memory": True})):
        for layers in (1, 5):
            more = {**extra, "nvme_path": str(tmp_path / f"{mode}{layers}")} if extra else {}
            done = subprocess.run(
                [sys.executable, "-c", _GROWTH, json.dumps({**options, **more, "layers": layers})],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert done.returncode == 0, done.stderr
            runs[mode, layers] = json.loads(done.stdout)
    state = runs["memory", 5]["state"] - runs["memory", 1]["state"]
    assert (
        state > 200 << 20 and runs["nvme", 5]["swapped_params"] == 4 * 5
    )  # 4 matrices a layer (the embedding is under 1 MiB)
    grown = {mode: runs[mode, 5]["resident"] - runs[mode, 1]["resident"] for mode in ("memory", "nvme")}
    assert grown["memory"] > 0.8 * state, (grown, state)
    assert grown["nvme"] < 0.15 * state, (grown, state)
