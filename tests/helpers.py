"""Helpers the test files share: the bundled samples and their DeepSpeed reference outputs, running
the command line, comparing trees and files. Test files import from here, never from one another."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from zckpt.core.dtypes import FP16, from_torch
from zckpt.core.index import Segment
from zckpt.deepspeed.writer import carry
from zckpt.io.reading import FileReader, read_ref
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import save as torchsave
from zckpt.torchfile.reader import PickledObject, TensorRef
from zckpt.torchfile.save import Copy, Inline, OutTensor

ROOT = Path(__file__).resolve().parent.parent


def default_signals() -> None:
    """preexec_fn for a child that is signalled: SIGINT, SIGTERM and SIGHUP at their default
    dispositions, whatever this run inherited (a background or nohup test run has SIGINT or
    SIGHUP ignored, which zckpt then keeps ignoring, as it should)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


SAMPLES = ROOT / "sample_ckpts"


@dataclass(frozen=True)
class Sample:
    name: str
    folder: Path
    meta: dict

    @property
    def checkpoint(self) -> Path:
        return self.folder / self.meta.get("checkpoint", "checkpoint")

    @property
    def reference_file(self) -> Path:
        return self.folder / "reference" / "zero_to_fp32" / "pytorch_model.bin"

    @property
    def has_reference(self) -> bool:
        """False where DeepSpeed's own tool failed on the checkpoint (meta.json says how)."""
        return not self.meta.get("reference_error")

    def reference(self) -> dict[str, torch.Tensor]:
        """DeepSpeed zero_to_fp32.py's output (plain tensors, safe to load weights_only)."""
        if not self.has_reference:
            pytest.skip(f"zero_to_fp32.py failed on this checkpoint: {self.meta['reference_error']}")
        return torch.load(self.reference_file, weights_only=True)

    def expected_fp32(self) -> dict[str, torch.Tensor]:
        """What fp32 consolidation must give: zero_to_fp32.py's output where it has one, else
        the live values with floating tensors widened to fp32 (exact)."""
        if self.has_reference:
            return self.reference()
        return {n: t.float() if t.is_floating_point() else t for n, t in self.live().items()}

    @property
    def optimizer(self) -> str:
        """The optimizer type the run's ds_config names (AdamW, Adam, SGD, ...)."""
        return (self.meta.get("ds_config", {}).get("optimizer") or {}).get("type", "AdamW")

    @property
    def muon(self) -> bool:
        """Trained with DeepSpeed's Muon (MuonWithAuxAdam): a Muon group and an Adam group."""
        return self.optimizer.lower() == "muon"

    @property
    def state_names(self) -> list[str]:
        """The per-element states torch's optimizer keeps: SGD its momentum, Adam its two moments
        (AMSGrad a third), Adagrad its sum, Adamax exp_avg and exp_inf, RMSprop square_avg (and a
        momentum_buffer, a grad_avg); DeepSpeed's Muon the momentum of its Muon group's params and
        Adam's two moments of the rest (:meth:`param_state_names` says which param has which)."""
        kind = self.optimizer.lower()
        params = (self.meta.get("ds_config", {}).get("optimizer") or {}).get("params", {})
        if kind == "sgd":
            return ["momentum_buffer"]
        if self.muon:
            return ["momentum_buffer", "exp_avg", "exp_avg_sq"]
        if kind == "adagrad":  # torch's keeps a sum; DeepSpeedCPUAdagrad (optimizer offloaded) an exp_avg_sq
            return ["exp_avg_sq"] if self.cpu_optimizer else ["sum"]
        if kind == "adamax":
            return ["exp_avg", "exp_inf"]
        if kind == "rmsprop":  # in the order torch creates them
            return [
                "square_avg",
                *(["momentum_buffer"] if params.get("momentum") else []),
                *(["grad_avg"] if params.get("centered") else []),
            ]
        # Adam, AdamW (torch's, FusedAdam, DeepSpeedCPUAdam), RAdam, NAdam, DeepSpeedCPULion (its
        # exp_avg_sq stays zero)
        return ["exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if params.get("amsgrad") else [])]

    @property
    def cpu_optimizer(self) -> bool:
        """Whether DeepSpeed built its own CPU optimizer (the optimizer offloaded to CPU and
        zero_force_ds_cpu_optimizer left on): DeepSpeedCPUAdam / Adagrad / Lion."""
        config = self.meta.get("ds_config", {})
        offload = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
        return offload == "cpu" and config.get("zero_force_ds_cpu_optimizer", True) is not False

    def param_state_names(self, name: str, live_optim: dict[str, torch.Tensor]) -> list[str]:
        """The states param `name` has: under Muon, its group's (the live capture names them)."""
        if not self.muon:
            return self.state_names
        return [k for k in self.state_names if f"{name}.{k}" in live_optim]

    @property
    def scalar_names(self) -> list[str]:
        """The per-param scalar states beside the step (torch's NAdam: mu_product)."""
        return ["mu_product"] if self.optimizer.lower() == "nadam" else []

    @property
    def counts_steps(self) -> bool:
        """Whether the optimizer keeps a per-param step (torch's SGD keeps none; Muon's Adam group
        keeps one, its Muon group none: tests that need a step of every group skip Muon)."""
        return self.optimizer.lower() not in ("sgd", "muon")

    def live(self) -> dict[str, torch.Tensor]:
        """fp32 masters, frozen params and buffers read from the live engine before saving."""
        from safetensors.torch import load_file

        return load_file(self.folder / "reference" / "live.safetensors")

    @property
    def zenflow(self) -> dict | None:
        """The run's ``zero_optimization.zenflow`` (None: not a ZenFlow run). ZenFlow makes
        ``update_interval`` the gradient accumulation steps: meta's ``steps`` counts micro-steps."""
        return self.meta.get("ds_config", {}).get("zero_optimization", {}).get("zenflow")

    def live_params16(self) -> dict[str, torch.Tensor]:
        """The engine module's 16-bit trainable params right before the save (ZenFlow samples)."""
        from safetensors.torch import load_file

        return load_file(self.folder / "reference" / "live_params16.safetensors")


def load_samples() -> list[Sample]:
    samples = []
    for meta_file in sorted(SAMPLES.glob("*/meta.json")):
        samples.append(Sample(meta_file.parent.name, meta_file.parent, json.loads(meta_file.read_text())))
    return samples


ALL_SAMPLES = load_samples()
# the data-parallel samples (scripts/make_sample_ckpts.py), which the generic tests go over, and the
# pipeline-parallel and mixture-of-experts ones (scripts/make_parallel_ckpts.py: other models, a
# meta.json of their own), which tests/test_deepspeed/test_pipeline.py and test_moe.py cover, and
# PyTorch Lightning's (scripts/make_lightning_ckpts.py), which tests/test_ops/test_lightning.py covers
LIGHTNING_SAMPLES = [s for s in ALL_SAMPLES if "lightning" in s.meta]
# the ZeRO-0 samples (no ZeRO files: a torch optimizer's state by index; zckpt writes them as ZeRO-1/2/3),
# which tests/test_deepspeed/test_zero0.py covers; the generic tests compare ZeRO files
ZERO0_SAMPLES = [s for s in ALL_SAMPLES if s.meta.get("zero_stage") == 0]
SAMPLE_LIST = [s for s in ALL_SAMPLES if "pp" not in s.meta and "lightning" not in s.meta and s not in ZERO0_SAMPLES]
PIPELINE_SAMPLES = [
    s
    for s in ALL_SAMPLES
    if "pp" in s.meta and not s.meta.get("ep") and not s.meta.get("tp") and s not in ZERO0_SAMPLES
]
MOE_SAMPLES = [s for s in ALL_SAMPLES if s.meta.get("ep") and s not in ZERO0_SAMPLES]
TENSOR_PARALLEL_SAMPLES = [s for s in ALL_SAMPLES if s.meta.get("tp") and "mpu" not in s.meta]  # AutoTP
# an mpu's tensor ranks, with ds_to_universal's merge beside them (the ZeRO-0 one has none: ZERO0_SAMPLES)
MEGATRON_SAMPLES = [s for s in ALL_SAMPLES if "mpu" in s.meta and s.meta["pp"] == 1 and s not in ZERO0_SAMPLES]
# pipeline x tensor, with ds_to_universal's merge beside them; and one that ties a module across stages
# (ds_to_universal fails on it: the live engine's slices and moments are its reference)
PIPELINE_TENSOR_SAMPLES = [s for s in ALL_SAMPLES if "mpu" in s.meta and s.meta["pp"] > 1 and not s.meta.get("tied")]
TIED_PIPELINE_TENSOR_SAMPLES = [s for s in ALL_SAMPLES if "mpu" in s.meta and s.meta["pp"] > 1 and s.meta.get("tied")]


def sample(name: str) -> Sample:
    return next(s for s in ALL_SAMPLES if s.name == name)


def assert_holds_the_merge(state: Any, reference: dict[str, torch.Tensor], masters: bool = False) -> None:
    """Every param's Adam moments of a training state (and with `masters` its fp32 master) equal
    `reference`'s ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` (``<name>``): DeepSpeed's own merge
    of a tensor-parallel checkpoint (``reference/universal.safetensors``)."""
    from zckpt.io.materialize import read_tensor
    from zckpt.io.reading import FileReader

    with FileReader() as reader:
        for param in state.params:
            if masters:
                master = read_tensor(reader, param.master).reshape(param.shape)
                assert same_bits(master, reference[param.name]), param.name
            for key in ("exp_avg", "exp_avg_sq"):
                value = read_tensor(reader, param.states[key]).reshape(param.shape)
                assert same_bits(value, reference[f"{param.name}.{key}"]), (param.name, key)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every bit (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))) if a.numel() else True


def assert_same_objects(ours: Any, theirs: Any, where: str = "") -> None:
    """Deep equality of two loaded objects: types, key order (and a state_dict's ``_metadata``),
    arrays and tensors by dtype, layout, requires_grad and bits, other objects by their attributes
    or by ==."""
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(ours, np.ndarray):
        assert (
            ours.dtype == theirs.dtype
            and ours.flags.f_contiguous == theirs.flags.f_contiguous
            and np.array_equal(ours, theirs)
        ), where
    elif isinstance(ours, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.requires_grad) == (theirs.dtype, theirs.shape, theirs.requires_grad), where
        assert same_bits(ours, theirs), where
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs), where
        if isinstance(ours, OrderedDict):
            assert vars(ours) == vars(theirs), where  # a state_dict's _metadata
        for key in ours:
            assert_same_objects(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_objects(a, b, f"{where}[{i}]")
    elif hasattr(ours, "__dict__") and not isinstance(ours, type) and not callable(ours):
        assert_same_objects(vars(ours), vars(theirs), where)
    else:
        assert ours == theirs, (where, ours, theirs)


def run_zckpt_torchrun(*args: str, processes: int = 2, check: bool = True) -> "subprocess.CompletedProcess[str]":
    """`torchrun --nproc-per-node <processes> -m zckpt <args>` on a free port; fails the test
    with the processes' stderr when they fail (unless not `check`)."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(processes),
            "--master-port",
            str(port),
            "-m",
            "zckpt",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 or not check, result.stderr[-3000:]
    return result


def run_cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m zckpt ARGS` in a child process, run from `cwd`: what a user's shell gets."""
    return subprocess.run(
        [sys.executable, "-m", "zckpt", *map(str, args)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


RESHARDABLE = [
    s
    for s in SAMPLE_LIST
    if s.meta["ds_config"]["zero_optimization"].get("offload_optimizer", {}).get("device") != "nvme"
]


# the ZeRO-3 tensors whose padding DeepSpeed leaves uninitialised (partition_param's torch.empty):
# the fp32 partitions and frozen fragments, and so also the optimizer states a coupled weight
# decay computes from them (SGD's momentum, Adam's moments with L2 decay)
ZERO3_PADDED = frozenset(
    {
        "/optimizer_state_dict/fp32_flat_groups",
        "/optimizer_state_dict/optimizer_state_dict/state",
        "/frozen_param_fragments",
    }
)

# ZeRO-1/2 pad a group's flat partition with zeros, but an optimizer may compute a nonzero state
# from the zero gradient there: Adamax's exp_inf = max(beta2 * exp_inf, |grad| + eps) holds eps
ZERO12_PADDED_STATES = "/optimizer_state_dict/base_optimizer_state/state"


def drop_zenflow_module_weights(case: Sample, original: dict, ours: dict, reader: FileReader) -> None:
    """A round trip through ZeRO-3 or a universal folder, neither of which holds 16-bit weights,
    gives a ZenFlow run's module weights back as the masters rounded (what DeepSpeed's load of
    either rebuilds them from), not the live engine's that ZenFlow saved: checks ours are the live
    masters rounded by torch, and takes the trainable weights out of both model-states trees."""
    if not case.zenflow or "module" not in original:
        return
    live = case.live()
    for name, saved in case.live_params16().items():
        original["module"].pop(name)
        got = torch.from_numpy(read_ref(reader, ours["module"].pop(name)).copy()).view(saved.dtype)
        assert same_bits(got.view(saved.shape), live[name].to(saved.dtype)), name


def padded_paths(case: Sample, stage: int) -> set[str]:
    """The tensors of a ZeRO-`stage` checkpoint of `case` whose padding zckpt writes as zeros and
    DeepSpeed may not (compare_trees' `padded`)."""
    if stage == 3:
        return set(ZERO3_PADDED)
    return {ZERO12_PADDED_STATES} if case.optimizer.lower() == "adamax" else set()


def _padding_free(ref: TensorRef, other: TensorRef, reader: FileReader) -> tuple[np.ndarray, np.ndarray]:
    return read_ref(reader, ref).reshape(-1), read_ref(reader, other).reshape(-1)


def compare_trees(original, ours, reader: FileReader, path: str = "", padded: set[str] | None = None) -> list[str]:
    """Differences between two unpickled object trees; tensors compared by bytes. Tensors whose
    path is in `padded` hold DeepSpeed's uninitialised padding: there, elements that are zero in
    ours may differ."""
    problems: list[str] = []
    if isinstance(original, TensorRef):
        if not isinstance(ours, TensorRef):
            return [f"{path}: tensor became {type(ours).__name__}"]
        if (original.dtype, original.shape) != (ours.dtype, ours.shape):
            return [f"{path}: {original.dtype}{list(original.shape)} became {ours.dtype}{list(ours.shape)}"]
        if (original.attributes or {}) != (ours.attributes or {}):
            problems.append(f"{path}: attributes {original.attributes} became {ours.attributes}")
        a, b = _padding_free(original, ours, reader)
        differ = a.view(np.uint8) != b.view(np.uint8)
        if differ.any():
            if padded is not None and any(path.startswith(p) for p in padded):
                raw_b = b.view(np.dtype(f"u{b.itemsize}")) if b.dtype.kind != "u" else b
                if not (raw_b[(a != b)] == 0).all():
                    problems.append(f"{path}: differs outside zero padding")
            else:
                problems.append(f"{path}: {int(np.count_nonzero(a != b))} elements differ")
        return problems
    if type(original) is not type(ours) and not (isinstance(original, dict) and isinstance(ours, dict)):
        return [f"{path}: {type(original).__name__} became {type(ours).__name__}"]
    if isinstance(original, PickledObject):
        return compare_trees(vars(original), vars(ours), reader, path + ".__dict__", padded) + (
            [f"{path}: class {original.original_class} became {ours.original_class}"]
            if original.original_class != ours.original_class
            else []
        )
    if isinstance(original, dict):
        if list(original) != list(ours):
            return [f"{path}: keys {list(original)} became {list(ours)}"]
        for key in original:
            problems += compare_trees(original[key], ours[key], reader, f"{path}/{key}", padded)
        return problems
    if isinstance(original, (list, tuple)):
        if len(original) != len(ours):
            return [f"{path}: length {len(original)} became {len(ours)}"]
        for i, (a, b) in enumerate(zip(original, ours)):
            problems += compare_trees(a, b, reader, f"{path}[{i}]", padded)
        return problems
    return [] if original == ours else [f"{path}: {original!r:.80} became {ours!r:.80}"]


def copy_checkpoint(tmp_path: Path, case: Sample) -> Path:
    """A copy of a sample's checkpoint folder to damage; returns its tag folder."""
    checkpoint = tmp_path / case.name
    shutil.copytree(case.checkpoint, checkpoint)
    return checkpoint / (checkpoint / "latest").read_text().strip()


def same_checkpoint_files(original: Path, ours: Path) -> list[str]:
    """The differences between two checkpoint folders' tag folders: the file names, then every
    file's pickled tree and tensor bytes (what torch.load would give)."""
    from zckpt.torchfile import reader as torchfile

    theirs, mine = tag_files(original), tag_files(ours)
    if sorted(theirs) != sorted(mine):
        return [f"files {sorted(theirs)} became {sorted(mine)}"]
    problems = []
    with FileReader() as reader:
        for name, path in theirs.items():
            problems += [
                f"{name}{p}" for p in compare_trees(torchfile.load(str(path)), torchfile.load(str(mine[name])), reader)
            ]
    return problems


def tag_files(folder: Path) -> dict[str, Path]:
    tag = (folder / "latest").read_text().strip()
    return {p.name: p for p in sorted((folder / tag).glob("*.pt"))}


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def data_records(path: Path) -> list[zipfile.ZipInfo]:
    """The tensor records of a torch archive, as Python's zipfile lists them."""
    with zipfile.ZipFile(path) as archive:
        return [i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 0]


def record_start(path: Path, info: zipfile.ZipInfo) -> int:
    with open(path, "rb") as handle:
        handle.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(handle.read(2), "little"), int.from_bytes(handle.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def as_saved_to_a_stream(path: Path) -> None:
    """The file as torch.save writes it to a stream rather than a path: its records under the
    folder "archive" (PyTorchStreamWriter's name then), bytes and CRCs otherwise the same."""
    with zipfile.ZipFile(path) as archive:
        items = [(i, archive.read(i.filename)) for i in archive.infolist()]
    with zipfile.ZipFile(f"{path}.new", "w") as archive:
        for info, data in items:
            record = zipfile.ZipInfo("archive/" + info.filename.split("/", 1)[1], date_time=info.date_time)
            archive.writestr(record, data)  # stored, as torch stores every record
    os.replace(f"{path}.new", path)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x10]))


class Source:
    """A scratch file holding tensors' raw bytes; hands out Copy parts that point into it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(b"\x01" * 13)  # an odd prefix: segments do not start aligned

    def out(self, tensor: torch.Tensor, **kwargs: Any) -> OutTensor:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        offset = self.path.stat().st_size
        with open(self.path, "ab") as handle:
            handle.write(raw)
        dtype = from_torch(tensor.dtype)
        parts = (Copy(Segment(str(self.path), offset, tensor.numel()), dtype),) if tensor.numel() else ()
        return OutTensor(dtype, tuple(tensor.shape), parts, **kwargs)


def inline(tensor: torch.Tensor) -> OutTensor:
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return OutTensor(from_torch(tensor.dtype), tuple(tensor.shape), (Inline(raw),) if raw else ())


def serialization_id(path: Path) -> tuple[bytes, int]:
    with zipfile.ZipFile(path) as archive:
        info = archive.infolist()[-1]
        assert info.filename.endswith("/.data/serialization_id")
        return archive.read(info), info.CRC


def same_except_serialization_id(ours: Path, theirs: Path) -> None:
    """Every byte equal once torch's random serialization id (content and CRC) is swapped in."""
    (our_id, our_crc), (their_id, their_crc) = serialization_id(ours), serialization_id(theirs)
    assert len(our_id) == len(their_id) == 40 and our_id.isdigit()
    data = ours.read_bytes()
    assert data.count(our_id) == 1 and data.count(struct.pack("<I", our_crc)) == 2  # descriptor + directory
    data = data.replace(our_id, their_id).replace(struct.pack("<I", our_crc), struct.pack("<I", their_crc))
    expected = theirs.read_bytes()
    assert len(data) == len(expected)
    first = next((i for i, (a, b) in enumerate(zip(data, expected)) if a != b), None)
    assert first is None, f"first difference at byte {first}"


def torch_and_ours(source: Source) -> tuple[dict, dict]:
    """The same state as torch objects and as writer objects."""
    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch_state = OrderedDict(
        f32=torch.linspace(-3, 3, 17),
        bf16=torch.randn(5, 7).to(torch.bfloat16),
        f16=torch.randn(3, 2, 2).to(torch.float16),
        f64=torch.tensor([1.5, -2.25]),
        i64=torch.tensor([[1, -2, 3], [2**40, 5, 6]]),
        i32=torch.tensor([7, 8], dtype=torch.int32),
        i8=torch.tensor([-1, 2], dtype=torch.int8),
        u8=torch.tensor([250, 3], dtype=torch.uint8),
        flags=torch.tensor([True, False, True]),
        scalar=torch.tensor(3.5),
        step=torch.tensor(12, dtype=torch.int64),
        empty=torch.empty(0, dtype=torch.bfloat16),
        empty2d=torch.empty(3, 0),
        shared=shared,
        again=shared,  # the same tensor object twice: one storage, a memo reference
    )
    ours = OrderedDict((k, source.out(v)) for k, v in torch_state.items() if k != "again")
    ours["again"] = ours["shared"]
    ours["step"] = inline(torch_state["step"])  # Inline parts beside Copy parts
    extras = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "nums": [1, -1, 255, 256, 65535, 65536, -(2**31), 2**31, 2**70, -(2**70)],
        "flags": [True, False, None],
        "names": ["x", "é", "", "cpu"],
        "blob": b"\x00\xffbytes",
        "tuple4": (1, 2, 3, 4),
        "nested": OrderedDict(a={"b": [()]}),
        "empty": {},
        "aset": {3, 1},
        "none_set": set(),
        "big_list": list(range(1200)),
        "big_dict": {i: float(i) for i in range(1100)},
        "np": np.float64(0.125),
        "dtype": torch.float16,
    }
    our_extras = {**extras, "dtype": FP16}
    return {"state": torch_state, **extras}, {"state": ours, **our_extras}


def listing(root: Path, skip: Path | None = None) -> dict[str, str]:
    """Every path under `root` (not following links) and what it is: a link's target, a file's
    content hash, or 'folder'; `skip` and what lies under it left out."""
    found = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if skip is not None and (here == skip or skip in here.parents):
            dirs[:] = []
            continue
        for name in dirs + files:
            path = here / name
            if skip is not None and path == skip:
                continue
            if path.is_symlink():
                found[str(path)] = "link -> " + os.readlink(path)
            elif path.is_dir():
                found[str(path)] = "folder"
            else:
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def renamed(obj: Any, old: str, new: str) -> Any:
    """A tree read by zckpt's unpickler (made writable by `carry`) with every dict key `old`
    renamed `new`, in place in its order."""
    if isinstance(obj, dict):
        out = type(obj)((new if k == old else k, renamed(v, old, new)) for k, v in obj.items())
        if isinstance(obj, OrderedDict):
            vars(out).update(vars(obj))  # a state_dict's _metadata
        return out
    if isinstance(obj, list):
        return [renamed(v, old, new) for v in obj]
    return obj


def rename_everywhere(tag_dir: Path, old: str, new: str) -> None:
    """Rename a param or optimizer-state key in every torch file of a tag folder (module, shapes,
    param_slice_mappings, optimizer state), so the checkpoint stays consistent."""
    for path in sorted(tag_dir.rglob("*.pt")):
        tree = renamed(carry(torchfile.load(path)), old, new)
        torchsave.save(tree, str(path) + ".new")
        os.replace(str(path) + ".new", path)


def load_output(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a consolidated folder, whatever its format and sharding."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    for file in sorted(folder.glob("pytorch_model*.bin")):
        state.update(torch.load(file, weights_only=True))
    return state


SMALL = ["--layers", "1", "--dim", "16", "--heads", "2", "--vocab", "31", "--seq-len", "8", "--micro-batch", "2"]


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ZCKPT_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# the command line in-process (typer's test runner)
try:  # click < 8.2 mixes stderr into output unless told not to; 8.2 always keeps it apart
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()


class _StandIns(types.ModuleType):
    """A pickle module for torch.load whose Unpickler turns DeepSpeed's classes (not installed in
    this tier) into plain stand-ins, so files are read by torch itself, not by zckpt."""

    classes: dict[tuple[str, str], type] = {}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module.split(".")[0] == "deepspeed":
                key = (module, name)
                if key not in _StandIns.classes:
                    _StandIns.classes[key] = type(name, (_StandIn,), {})
                return _StandIns.classes[key]
            return super().find_class(module, name)

    load = staticmethod(pickle.load)


class _StandIn:
    def __init__(self, *args) -> None:  # an enum rebuilt by value: ZeroStageEnum(3)
        self.args = args

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)


def load_with_stand_ins(path: Path) -> Any:
    """A DeepSpeed file read by torch.load itself (not zckpt), DeepSpeed's classes as inert stand-ins."""
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_StandIns("stand_ins"))


VOCABULARY = ("embed.word_embeddings.weight", "lm_head.weight")  # the Megatron samples' vocabulary params


def assert_padded_vocabulary_is_live(state: Any, case: Sample) -> None:
    """A Megatron sample's state at one tensor rank with its vocabulary padded as saved: each
    vocabulary param's master and moments are its tensor ranks' live slices joined (padding rows
    included), every other param's ds_to_universal's merge (``reference/universal.safetensors``)."""
    from zckpt.io.materialize import read_tensor

    ranks = range(case.meta["tp"])
    live = [load_file(case.folder / "reference" / f"live_tp{t}.safetensors") for t in ranks]
    moments = [load_file(case.folder / "reference" / f"live_optimizer_tp{t}.safetensors") for t in ranks]
    reference = load_file(case.folder / "reference" / "universal.safetensors")
    assert not state.tensor_shards and state.index.topology.tp == 1
    with FileReader() as reader:
        for param in state.params:
            if param.name not in VOCABULARY:
                continue
            truths = [(param.master, torch.cat([r[param.name] for r in live]))]
            truths += [
                (param.states[k], torch.cat([m[f"{param.name}.{k}"] for m in moments]))
                for k in ("exp_avg", "exp_avg_sq")
            ]
            for source, truth in truths:
                assert same_bits(read_tensor(reader, source).reshape(param.shape), truth), param.name
    others = replace(state, params=tuple(p for p in state.params if p.name not in VOCABULARY))
    assert {p.name for p in state.params} - {p.name for p in others.params} == set(VOCABULARY)
    assert_holds_the_merge(others, reference, masters=True)


def megatron_slice(name: str, whole: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """Tensor rank `t` of `tp`'s slice of a Megatron sample's param, cut from the whole tensor as
    the sample's model cuts it (``scripts/make_parallel_ckpts.py``, ``megatron_modules``: a row
    chunk, a column chunk for the row-parallel projections, a row chunk of each q/k/v part and of
    each SwiGLU half, the LayerNorms and row-parallel biases whole)."""

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(tp, dim=0)[t]

    if "norm." in name or name.endswith(("dense.bias", "dense_4h_to_h.bias")):
        return whole
    if name.endswith(("dense.weight", "dense_4h_to_h.weight")):
        return whole.chunk(tp, dim=1)[t]
    if "query_key_value" in name:
        return torch.cat([rows(part) for part in whole.split([8, 4, 4])])
    if name.startswith(("layers.0.mlp.dense_h_to_4h", "1.mlp.dense_h_to_4h")):  # the SwiGLU layer's two halves
        # (its name in the model, and in the pipeline model, where it is layer 1)
        return torch.cat([rows(part) for part in whole.split(whole.shape[0] // 2)])
    return rows(whole)


def megatron_join(name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor of a Megatron sample's param from its tensor ranks' slices, joined as the
    sample's model cut it (:func:`megatron_slice` taken the other way; the vocabulary padded)."""
    tp = len(slices)
    if "norm." in name or name.endswith(("dense.bias", "dense_4h_to_h.bias")):
        assert all(torch.equal(s, slices[0]) for s in slices), name
        return slices[0]
    if name.endswith(("dense.weight", "dense_4h_to_h.weight")):
        return torch.cat(slices, dim=1)
    if "query_key_value" in name:
        parts = [s.split([8 // tp, 4 // tp, 4 // tp]) for s in slices]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    if name.startswith(("layers.0.mlp.dense_h_to_4h", "1.mlp.dense_h_to_4h")):
        halves = [s.split(s.shape[0] // 2) for s in slices]
        return torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
    return torch.cat(slices)


def assert_pipeline_slices_are_live(state: Any, case: Sample, tp: int) -> None:
    """Each stage's tensor ranks in a pipeline x tensor state (at the sample's own stages, `tp`
    tensor ranks) hold their slices (:func:`megatron_slice`) of what that stage's live engine held,
    its own copies of a tied module included: masters and Adam moments, the vocabulary at its
    saved padded rows (at one tensor rank: unpadded)."""
    from zckpt.io.materialize import read_tensor

    saved = case.meta["tp"]
    reference = case.folder / "reference"
    with FileReader() as reader:
        for number, stage in enumerate(state.stages):
            live = [load_file(reference / f"live_stage{number}_tp{t}.safetensors") for t in range(saved)]
            moments = [load_file(reference / f"live_optimizer_stage{number}_tp{t}.safetensors") for t in range(saved)]
            own = {p.name: p for p in stage.own_params}
            shards = stage.tensor_shards or [
                replace(state, params=tuple(own.get(n, state.param(n)) for n in stage.params))
            ]
            assert len(shards) == tp
            for t, shard in enumerate(shards):
                assert sorted(p.name for p in shard.params) == sorted(live[0]), (number, t)
                for param in shard.params:
                    pairs = [(param.master, live, param.name)]
                    pairs += [(param.states[k], moments, f"{param.name}.{k}") for k in ("exp_avg", "exp_avg_sq")]
                    for source, held, key in pairs:
                        whole = megatron_join(param.name, [h[key] for h in held])
                        if "word_embeddings" in param.name and tp == 1:
                            whole = whole[: int(case.meta["model"]["megatron_gpt"].split()[1])]  # unpadded
                        truth = megatron_slice(param.name, whole, tp, t)
                        value = read_tensor(reader, source).reshape(param.shape)
                        assert same_bits(value, truth), (number, t, key)


def assert_megatron_slices(state: Any, case: Sample, tp: int) -> None:
    """Each of `tp` tensor ranks' shards in a training state holds its slice (:func:`megatron_slice`)
    of what the sample's run held: masters and Adam moments ds_to_universal's merge
    (``reference/universal.safetensors``), the vocabulary params the saving ranks' live slices
    joined (the padding rows as trained)."""
    from zckpt.io.materialize import read_tensor

    saved = range(case.meta["tp"])
    live = [load_file(case.folder / "reference" / f"live_tp{r}.safetensors") for r in saved]
    moments = [load_file(case.folder / "reference" / f"live_optimizer_tp{r}.safetensors") for r in saved]
    reference = load_file(case.folder / "reference" / "universal.safetensors")

    def whole(name: str, key: str | None) -> torch.Tensor:
        if name in VOCABULARY:
            return torch.cat([r[name] for r in live] if key is None else [m[f"{name}.{key}"] for m in moments])
        return reference[name if key is None else f"{name}.{key}"]

    assert len(state.tensor_shards) == tp and state.index.topology.tp == tp
    with FileReader() as reader:
        for t, shard in enumerate(state.tensor_shards):
            assert sorted(p.name for p in shard.params) == sorted(live[0]), t
            for param in shard.params:
                pairs = [(param.master, None)] + [(param.states[k], k) for k in ("exp_avg", "exp_avg_sq")]
                for source, key in pairs:
                    truth = megatron_slice(param.name, whole(param.name, key), tp, t)
                    value = read_tensor(reader, source).reshape(param.shape)
                    assert same_bits(value, truth), (t, param.name, key)


def assert_slices_are_live(state: Any, case: Sample, cut: dict[str, int] | None = None) -> None:
    """Each tensor rank's shards in a training state hold what that rank's live engine held: every
    slice's master and Adam moments (``reference/live_tp{T}`` and ``live_optimizer_tp{T}``). `cut`:
    params whose rows from that index of the whole tensor on are vocabulary padding, zeros here
    (a universal folder holds the vocabulary unpadded and DeepSpeed's loader pads it with zeros)."""
    from safetensors.torch import load_file

    from zckpt.io.materialize import read_tensor
    from zckpt.io.reading import FileReader

    assert state.tensor_shards
    with FileReader() as reader:
        for t, shard in enumerate(state.tensor_shards):
            live = load_file(case.folder / "reference" / f"live_tp{t}.safetensors")
            moments = load_file(case.folder / "reference" / f"live_optimizer_tp{t}.safetensors")
            assert {p.name for p in shard.params} == set(live)
            for param in shard.params:
                rows = param.shape[0]
                if cut and param.name in cut:  # this rank's rows below the cut
                    rows = max(0, min(rows, cut[param.name] - t * param.shape[0]))
                pairs = [(param.master, live[param.name])]
                pairs += [(param.states[k], moments[f"{param.name}.{k}"]) for k in ("exp_avg", "exp_avg_sq")]
                for source, truth in pairs:
                    value = read_tensor(reader, source).reshape(param.shape)
                    assert same_bits(value[:rows], truth[:rows]), (t, param.name)
                    assert not value[rows:].any(), (t, param.name)


def deepspeed_base_state(inner: dict) -> dict:
    """The torch optimizer state ({state, param_groups}) of a ZeRO-1/2 optimizer file as DeepSpeed
    saved it. A run with zero_optimization.elastic_checkpoint saves a list of per-group states
    (less the group's padding) and no param groups: its groups are then those DeepSpeed saved for
    the same optimizer config (torch's AdamW, lr 1e-2, weight decay 0.01) in the rigid sample
    z2_fp32_ws1, its state ``{g: the group's saved dict}``."""
    base = inner.get("base_optimizer_state")
    if not isinstance(base, list):
        return base if base is not None else inner["optimizer_state_dict"]
    rigid = sample("z2_fp32_ws1")
    saved = load_with_stand_ins(rigid.checkpoint / rigid.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    group = {k: v for k, v in saved["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0].items()}
    return {
        "state": dict(enumerate(base)),
        "param_groups": [{**group, "params": [g]} for g in range(len(base))],
    }


def rewrite_torch_file(path: Path, change) -> None:  # noqa: ANN001
    """Apply `change` to the object tree of a torch file (tensors carried as saved) and write it
    back in place: written beside, then renamed, as its tensors are read from `path` while the
    new file is written."""
    tree = carry(torchfile.load(path))
    change(tree)
    scratch = path.parent.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    torchsave.save(tree, scratch / path.name)
    os.replace(scratch / path.name, path)


def is_elastic(case: Sample) -> bool:
    """A run saved with zero_optimization.elastic_checkpoint (base_optimizer_state a list per group)."""
    return bool(case.meta.get("ds_config", {}).get("zero_optimization", {}).get("elastic_checkpoint"))
