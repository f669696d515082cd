"""Fuzz (issue #9, item 6): damaged copies of the samples, every case judged by its result.

Each case copies a sample, damages it one way, then runs `consolidate`, `inspect` and `verify`
(the Python API, in a worker process) and asserts:
- consolidate ends in a ZckptError of one line naming a file under the damaged checkpoint (and
  writes nothing), or writes weights equal, bit for bit, to the reference (`zero_to_fp32.py`'s
  output, or the live values where DeepSpeed's tool fails): never wrong weights with exit 0;
- inspect returns a report (it never raises on a folder it can describe);
- verify finds a problem in every case whose damage matters. Bytes that truly do not matter
  (a zip header's time stamp, version fields, the alignment padding in an extra field, a
  truncated swap file's alignment tail) may pass, but only where consolidate still gives the
  reference *and* torch's own zip reader (what torch.load, hence DeepSpeed, uses) still reads
  the file: a checkpoint DeepSpeed cannot load is damaged, whatever zckpt needs;
- no exception other than ZckptError anywhere, no hang (10 s per case), no huge allocation: the
  worker runs under RLIMIT_AS (its size after imports + 2 GiB; checked to hold), so an
  allocation sized from a damaged declared size fails as MemoryError, a failure.

What nothing can tell is counted apart, not hidden (each asserted as far as it goes):
- damage inside raw NVMe swap files (`*.swp`, no checksum): verify must say that swap files
  carry no checksum;
- a changed shape or a deleted entry of a `module` tensor that no other record describes (a
  buffer's shape, a ZeRO-1 frozen param): a different checkpoint, not a damaged one;

Mutation kinds (seeded, deterministic): truncation; bit flips in tensor data, in raw swap files,
in data.pkl (CRC left stale, as real damage leaves it) and in the zip structure (local headers,
central directory, end records); a deleted dict key and a wrong tensor shape (the file rewritten
with zckpt's own torch.save writer, CRCs right, so the damage reaches the parser and the layout
checks); absurd declared sizes (a storage's numel or a tensor's shape in data.pkl set huge, the
archive rebuilt with valid CRCs); two ranks' files swapped; one rank's file copied over
another's; a rank file replaced by the same-named file of another sample; a crafted name (a
path, an absolute path, ``..``, a control character, an over-long name) in `latest`, or given
to a param in every rank file (README, "What an untrusted checkpoint cannot do"): those cases
also run `to_universal` and `reshard`, and nothing may appear outside their output folders.
`ZCKPT_FUZZ_SCALE=8` runs four times the default cases. `test_zz_fuzz_counts` prints the cases of
each kind and their outcomes (`pytest -s`).
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import ROOT

SAMPLES = [
    "z3_fp32_ws2_tied_frozen",  # ZeRO-3, two ranks, tied and frozen params
    "z2_bf16_ws3_frozen_groups",  # ZeRO-2 bf16, three ranks, two param groups
    "z1_bf16_ws3_bf16optimizer_frozen",  # BF16_Optimizer layout
    "z1_fp32_ws2_roundrobin",  # round-robin gradients
    "z2_bf16_ws3_paramalign",  # per-param alignment padding
    "ds14_z3_fp32_ws2_subgroups_groups",  # DeepSpeed 0.14, ZeRO-3 sub-groups
    "z3_fp16_ws4_subgroups_frozen",  # four ranks
    "z3_bf16_ws2_nvmeoffload_frozen_tied_groups",  # NVMe swap files (13 MB: fewer cases)
]
KINDS = {  # kind: cases per sample and SCALE (the NVMe sample gets one)
    "truncate": 3,
    "flip-tensor-data": 3,
    "flip-swap-file": 4,  # the NVMe sample only
    "flip-data-pkl": 3,
    "flip-zip-structure": 4,
    "delete-key": 3,
    "wrong-shape": 3,
    "absurd-size": 3,
    "swap-ranks": 2,
    "duplicate-rank": 2,
    "foreign-rank": 2,
    "crafted-name": 2,
}
SCALE = int(os.environ.get("ZCKPT_FUZZ_SCALE", "2"))  # seeds per sample and kind, times KINDS (8 for a long run)
CASE_SECONDS = 10
WORKERS = 2
RESULTS: dict[str, list[dict]] = collections.defaultdict(list)

WORKER = r'''
import json, math, os, pickletools, random, resource, shutil, sys, tempfile, time, traceback, zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers import SAMPLE_LIST, sample, same_bits
from helpers import listing, rename_everywhere
from zckpt import ZckptError, consolidate, inspect_path, reshard, to_universal
from zckpt.core.index import Segment, TensorSource
from zckpt.deepspeed.writer import carry, tensor_of
from zckpt.io.reading import source_of
from zckpt.ops.verify import verify
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile import save as torchsave
from zckpt.torchfile.reader import TensorRef

# an allocation sized from a damaged declared size fails here instead of taking the machine
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), size + (2 << 30)))
REFERENCES = {}


def reference(case):
    if case.name not in REFERENCES:
        REFERENCES[case.name] = case.expected_fp32()
    return REFERENCES[case.name]


def resized(ref, numel, shape=None):
    """A writable tensor of the first `numel` elements of `ref` (shape `shape`, default flat)."""
    segment = source_of(ref).segments[0]
    return tensor_of(TensorSource(ref.dtype, shape or (numel,), (Segment(segment.path, segment.offset, numel),)))


def rank_files(tag):
    return sorted(p for p in tag.rglob("*") if p.is_file())


def torch_files(tag):
    return sorted(p for p in tag.glob("*.pt"))


def records(path):
    with zipfile.ZipFile(path) as archive:
        return archive.infolist()


def data_start(raw, info):
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len


def flip_bits(path, lo, hi, rng, count):
    raw = bytearray(path.read_bytes())
    spots = rng.sample(range(lo, hi), min(count, hi - lo))  # distinct bytes: no flip undone by another
    for at in spots:
        raw[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(raw))
    return spots


def rebuild(path, replace):
    """The archive written again by Python's zipfile (valid CRCs), records in `replace` swapped in."""
    with zipfile.ZipFile(path) as archive:
        items = [(i, replace.get(i.filename, None) or archive.read(i.filename)) for i in archive.infolist()]
    with zipfile.ZipFile(str(path) + ".new", "w") as archive:
        for info, data in items:
            record = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            record.compress_type = zipfile.ZIP_STORED
            archive.writestr(record, data)
    os.replace(str(path) + ".new", path)


def rewrite(path, change):
    """The file written again with zckpt's torch.save writer after `change(tree)`."""
    original = torchfile.load(path)
    tree = carry(original)
    what = change(original, tree)
    torchsave.save(tree, str(path) + ".new")
    os.replace(str(path) + ".new", path)
    return what


def containers(obj, trail=()):
    """(container, key, trail) for every dict entry and list item in a read tree."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield obj, key, trail + (key,)
            yield from containers(value, trail + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield obj, i, trail + (i,)
            yield from containers(value, trail + (i,))


def follow(tree, trail):
    for key in trail:
        tree = tree[key]
    return tree


def unrecorded(model, trail):
    """Why a change at `trail` cannot be told, or None: a model-states `module` entry that no
    other record describes (a buffer; a ZeRO-1 frozen param, which has no frozen_param_shapes)
    is a different checkpoint, not a damaged one: its shape and values are its own record."""
    if not isinstance(model, dict) or len(trail) != 2 or trail[0] != "module":
        return None
    shapes = model.get("param_shapes") or []
    described = {n for group in (shapes if isinstance(shapes, list) else [shapes]) for n in group} | set(model.get("frozen_param_shapes") or {})
    if trail[1] in described:
        return None
    return "a module entry no other record describes (buffer, or ZeRO-1 frozen param)"


# --- mutations: each returns (victim, what[, why it cannot be told[, {renamed param: new name}]]) ---


def m_truncate(tag, s, rng):
    victim = rng.choice(rank_files(tag))
    size = victim.stat().st_size
    cut = rng.choice([0, rng.randrange(size), size - rng.randint(1, min(size, 64)), rng.randrange(size // 2, size)])
    victim.write_bytes(victim.read_bytes()[:cut])
    return victim, f"cut to {cut} of {size} bytes"


def m_flip_swap_file(tag, s, rng):
    victim = rng.choice(sorted(tag.rglob("*.swp")))  # raw NVMe swap files: no checksum
    spots = flip_bits(victim, 0, victim.stat().st_size, rng, rng.randint(1, 8))
    return victim, f"bits at {spots} of a swap file"


def m_flip_tensor_data(tag, s, rng):
    victim = rng.choice(torch_files(tag))
    raw = victim.read_bytes()
    info = rng.choice([i for i in records(victim) if "/data/" in i.filename and i.file_size > 0])
    start = data_start(raw, info)
    spots = flip_bits(victim, start, start + info.file_size, rng, rng.randint(1, 8))
    return victim, f"bits in {info.filename} at {spots}"


def m_flip_data_pkl(tag, s, rng):
    victim = rng.choice(torch_files(tag))
    raw = victim.read_bytes()
    info = next(i for i in records(victim) if i.filename.endswith("data.pkl"))
    start = data_start(raw, info)
    spots = flip_bits(victim, start, start + info.file_size, rng, rng.randint(1, 4))
    return victim, f"bits in data.pkl at {spots}"


def m_flip_zip_structure(tag, s, rng):
    victim = rng.choice(torch_files(tag))
    raw = victim.read_bytes()
    infos = records(victim)
    where = rng.choice(["local header", "central directory", "end records"])
    if where == "local header":
        info = rng.choice(infos)
        lo, hi = info.header_offset, data_start(raw, info)
    else:
        with zipfile.ZipFile(victim) as archive:
            directory = archive.start_dir
        ends = min(x for x in (raw.find(b"PK\x06\x06", directory), raw.find(b"PK\x05\x06", directory)) if x >= 0)  # zip64 or plain end records
        lo, hi = (directory, ends) if where == "central directory" else (ends, len(raw))
    spots = flip_bits(victim, lo, hi, rng, 1)
    return victim, f"a bit in the {where} at {spots}"


def m_delete_key(tag, s, rng):
    victim = rng.choice(torch_files(tag))

    def change(original, tree):
        entries = [(trail, key) for container, key, trail in containers(original) if isinstance(container, dict)]
        trail, key = rng.choice(entries)
        del follow(tree, trail[:-1])[key]
        return f"deleted {'/'.join(map(str, trail))}", unrecorded(original, trail)

    return victim, *rewrite(victim, change)


def m_wrong_shape(tag, s, rng):
    victim = rng.choice(torch_files(tag))

    def change(original, tree):
        tensors = [trail for container, key, trail in containers(original) if isinstance(container[key], TensorRef) and container[key].numel > 1]
        trail = rng.choice(tensors)
        ref = follow(original, trail)
        how = rng.choice(["fewer", "reshaped", "one"])
        if how == "fewer":  # the first rows (or elements) only
            shape = (ref.shape[0] - 1, *ref.shape[1:]) if len(ref.shape) > 1 and ref.shape[0] > 1 else (rng.randrange(1, ref.numel),)
            new = resized(ref, math.prod(shape), shape)
        elif how == "reshaped":
            new = resized(ref, ref.numel, (1, ref.numel) if len(ref.shape) != 2 or ref.shape[0] != 1 else (ref.numel,))
        else:
            new = resized(ref, 1, (1,))
        follow(tree, trail[:-1])[trail[-1]] = new
        return f"{'/'.join(map(str, trail))} {tuple(ref.shape)} -> {how}", unrecorded(original, trail)

    return victim, *rewrite(victim, change)


def _int_ops(data):
    """(position, end, value, role) of the ints of every persistent id (numel) and of the
    storage offset and shape that follow it in data.pkl."""
    ops = list(pickletools.genops(data))
    found = []
    for i, (op, arg, pos) in enumerate(ops):
        if op.name != "BINPERSID":
            continue
        j = i - 1
        while ops[j][0].name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
            j -= 1
        if ops[j][0].name == "TUPLE" and ops[j - 1][0].name in ("BININT1", "BININT2", "BININT", "LONG1"):
            o, a, p = ops[j - 1]
            found.append((p, ops[j][2], a, "numel"))
        k = i + 1  # the storage offset, then the shape's ints up to the tuple
        if ops[k][0].name in ("BININT1", "BININT2", "BININT", "LONG1"):
            k += 1
            while k < len(ops) and ops[k][0].name in ("BININT1", "BININT2", "BININT", "LONG1"):
                found.append((ops[k][2], ops[k + 1][2], ops[k][1], "shape"))
                k += 1
    return found


def m_absurd_size(tag, s, rng):
    victim = rng.choice(torch_files(tag))
    with zipfile.ZipFile(victim) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    spots = _int_ops(data)
    pos, end, value, role = rng.choice(spots)
    huge = rng.choice([2**31 - 1, 10**12, 2**62, -1])
    encoded = b"J" + huge.to_bytes(4, "little", signed=True) if -(2**31) <= huge < 2**31 else b"\x8a\x08" + huge.to_bytes(8, "little", signed=True)
    rebuild(victim, {name: data[:pos] + encoded + data[end:]})
    return victim, f"{role} {value} -> {huge}"


def _same_kind(tag, rng):
    """Two files of one kind for two different ranks."""
    groups = {}
    for path in torch_files(tag):
        if "zero_pp_rank_" in path.name:
            kind = path.name.split("zero_pp_rank_")[0] + "|" + path.name.split("_mp_rank_")[1]
            groups.setdefault(kind, []).append(path)
    choices = [g for g in groups.values() if len(g) > 1]
    return rng.sample(rng.choice(choices), 2)


def m_swap_ranks(tag, s, rng):
    """Every sample's rank files were saved by torch.save under their own names, which the
    archives record: a swap is told whatever the files hold (no padding, ZeRO-3 model states)."""
    a, b = _same_kind(tag, rng)
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    return a, f"{a.name} <-> {b.name}"


def m_duplicate_rank(tag, s, rng):
    a, b = _same_kind(tag, rng)
    b.write_bytes(a.read_bytes())
    return b, f"{a.name} copied over {b.name}"


def m_foreign_rank(tag, s, rng):
    options = []
    for victim in torch_files(tag):
        for other in SAMPLE_LIST:
            theirs = other.checkpoint / other.meta.get("tag", "") / victim.name
            if other.name != s.name and theirs.is_file() and theirs.read_bytes() != victim.read_bytes():
                options.append((victim, theirs, other.name))
    victim, theirs, other = rng.choice(sorted(options))
    victim.write_bytes(theirs.read_bytes())
    return victim, f"{victim.name} from {other}"


# names that, taken as paths, lead out of a folder or are no file name (an absolute one is made
# per case, inside its own work folder, so an escape is seen by the listing)
CRAFTED_NAMES = ["../escape", "../../../../escape", "ABSOLUTE", ".", "..", "a/../../escape", "tag\nnext", "x" * 300, "nul\x00name"]


def m_crafted_name(tag, s, rng):
    """`latest` naming a crafted tag, or a param (not a tied one) renamed to a crafted name in
    every rank file, so the checkpoint stays consistent: the 4th item maps old to new name."""
    ckpt = tag.parent
    name = rng.choice(CRAFTED_NAMES).replace("ABSOLUTE", str(ckpt.parent / "abs_escape"))
    if rng.random() < 0.5 or "nvme" in s.name:  # 13 MB of rank files to rewrite: latest only
        (ckpt / "latest").write_text(name)
        return ckpt / "latest", f"latest names {name!r}", None, {}
    shapes = torchfile.load(next(tag.glob("*model_states.pt")))["param_shapes"]
    tied = set(s.meta["tied"]) | set(s.meta["tied"].values())
    param = rng.choice([n for group in ([shapes] if isinstance(shapes, dict) else shapes) for n in group if n not in tied])
    rename_everywhere(tag, param, name)
    return next(tag.glob("*model_states.pt")), f"param {param} renamed {name!r}", None, {param: name}


MUTATIONS = {
    "truncate": m_truncate, "flip-tensor-data": m_flip_tensor_data, "flip-swap-file": m_flip_swap_file, "flip-data-pkl": m_flip_data_pkl,
    "flip-zip-structure": m_flip_zip_structure, "delete-key": m_delete_key, "wrong-shape": m_wrong_shape,
    "absurd-size": m_absurd_size, "swap-ranks": m_swap_ranks, "duplicate-rank": m_duplicate_rank,
    "foreign-rank": m_foreign_rank, "crafted-name": m_crafted_name,
}


def torch_reads(path):
    """Whether torch's zip reader (what torch.load, hence DeepSpeed, uses) reads every record."""
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        for name in reader.get_all_records():
            reader.get_record(name)
        return True
    except Exception:
        return False


def attempt(call):
    """(outcome, detail) of a call: ("ok", value), ("error", ZckptError), ("memory"|"crash", text)."""
    try:
        return "ok", call()
    except ZckptError as exc:
        return "error", exc
    except MemoryError:
        return "memory", traceback.format_exc(limit=-6)
    except Exception:
        return "crash", traceback.format_exc(limit=-6)


def run_case(case):
    s = sample(case["sample"])
    rng = random.Random(f"{case['kind']}-{case['sample']}-{case['seed']}")
    work = Path(tempfile.mkdtemp(dir=case["tmp"]))
    ckpt = work / "ckpt"
    shutil.copytree(s.checkpoint, ckpt)
    victim, what, *rest = MUTATIONS[case["kind"]](ckpt / s.meta["tag"], s, rng)
    why = rest[0] if rest else None
    renames = rest[1] if len(rest) > 1 else {}
    result = {**case, "victim": str(victim.relative_to(ckpt)), "what": what, "untellable": why}
    times = {}
    outputs = [work / "out", work / "uc", work / "rs"]
    around = {p: h for p, h in listing(work).items() if not any(p.startswith(str(o)) for o in outputs)}

    start = time.monotonic()
    out = work / "out"
    outcome, value = attempt(lambda: consolidate(ckpt, out))
    times["consolidate"] = time.monotonic() - start
    if outcome == "ok":
        written = load_file(out / "model.safetensors")
        expected = {renames.get(k, k): t for k, t in reference(s).items()}  # a renamed param keeps its value
        equal = set(written) == set(expected) and all(same_bits(written[k], t) for k, t in expected.items())
        result["consolidate"] = "equal" if equal else "wrong"
        if not equal:
            result["detail"] = sorted(k for k in expected if k not in written or not same_bits(written[k], expected[k]))[:5]
    elif outcome == "error":
        message = str(value)
        clean = value.path is not None and "\n" not in message and value.path.startswith(str(ckpt)) and not out.exists()
        result["consolidate"] = "error" if clean else "unclean error"
        result["detail"] = message.replace(str(work), "")
    else:
        result["consolidate"], result["detail"] = outcome, value

    start = time.monotonic()
    outcome, value = attempt(lambda: inspect_path(str(ckpt)))
    times["inspect"] = time.monotonic() - start
    if outcome == "ok":
        result["inspect"] = "complete" if value["complete"] else "problems"
    else:
        result["inspect"], result["inspect_detail"] = outcome, str(value).replace(str(work), "")

    start = time.monotonic()
    outcome, value = attempt(lambda: verify(ckpt))
    times["verify"] = time.monotonic() - start
    if outcome == "ok":
        result["verify"] = "ok" if value.ok else "problems"
        result["verify_notes"] = list(value.notes)
        result["verify_problems"] = [p.replace(str(work), "") for p in value.problems][:3]
    else:
        result["verify"], result["verify_detail"] = outcome, str(value).replace(str(work), "")
    if result["verify"] == "ok" and victim.suffix == ".pt":  # does torch's own zip reader (DeepSpeed's load) take it?
        result["torch_reads"] = torch_reads(victim)
    if case["kind"] == "crafted-name":  # the commands where names become paths; nothing may land elsewhere
        for command, call in (("to_universal", lambda: to_universal(ckpt, work / "uc")), ("reshard", lambda: reshard(ckpt, work / "rs", world_size=1))):
            outcome, value = attempt(call)
            clean = outcome != "error" or (value.path is not None and value.path.startswith(str(ckpt)) and "\n" not in str(value))
            result[command] = outcome if clean else "unclean error"
            result[f"{command}_detail"] = str(value).replace(str(work), "")[:300]
        now = {p: h for p, h in listing(work).items() if not any(p.startswith(str(o)) for o in outputs)}
        result["escaped"] = sorted(p.replace(str(work), "") for p in set(now.items()) ^ set(around.items()))[:5]
    result["seconds"] = times
    shutil.rmtree(work, ignore_errors=True)
    return result


try:  # the limit works: this much cannot be had
    bytearray(3 << 30)
    limited = False
except MemoryError:
    limited = True
print(json.dumps({"ready": True, "limited": limited}), flush=True)
for line in sys.stdin:
    case = json.loads(line)
    try:
        result = run_case(case)
    except BaseException:
        result = {**case, "consolidate": "harness", "detail": traceback.format_exc()}
    print(json.dumps(result, default=str), flush=True)
'''


class Worker:
    """A process running cases one at a time (zckpt and torch imported once)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "ZCKPT_DEBUG"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
        env["OMP_NUM_THREADS"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER], env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._read(120) == {"ready": True, "limited": True}, "the worker's address-space limit does not hold"

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def run(self, case: dict) -> dict:
        self.process.stdin.write(json.dumps(case) + "\n")
        self.process.stdin.flush()
        result = self._read(CASE_SECONDS)
        if result is None:  # a hang, or the process died (a huge allocation the limit let through?)
            dead = self.process.poll()
            self.close()
            return {**case, "consolidate": "hang" if dead is None else f"worker died ({dead})"}
        return result

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Pool:
    def __init__(self) -> None:
        self.workers: list[Worker | None] = [None] * WORKERS
        self.lock = threading.Lock()
        self.free = list(range(WORKERS))

    def run(self, case: dict) -> dict:
        with self.lock:
            slot = self.free.pop()
        try:
            if self.workers[slot] is None or self.workers[slot].process.poll() is not None:
                self.workers[slot] = Worker()
            return self.workers[slot].run(case)
        finally:
            with self.lock:
                self.free.append(slot)

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.close()


@pytest.fixture(scope="module")
def pool():
    p = Pool()
    yield p
    p.close()


def failures_of(result: dict) -> list[str]:
    """What is wrong with one case's result (nothing: the case passed)."""
    problems = []
    swap = result["kind"] == "flip-swap-file"
    untellable = result.get("untellable")
    consolidated = result["consolidate"]
    if consolidated not in ("error", "equal", "wrong"):
        problems.append(f"consolidate: {consolidated}: {result.get('detail')}")
    if consolidated == "wrong" and not swap and not untellable:
        problems.append(f"consolidate gave wrong weights with exit 0: {result.get('detail')}")
    if result.get("inspect") not in ("complete", "problems"):
        problems.append(f"inspect: {result.get('inspect')}: {result.get('inspect_detail')}")
    if result.get("verify") not in ("ok", "problems"):
        problems.append(f"verify: {result.get('verify')}: {result.get('verify_detail')}")
    if swap:
        if not any("swap" in note and "checksum" in note for note in result.get("verify_notes", [])):
            problems.append(f"verify does not say swap files carry no checksum: {result.get('verify_notes')}")
    elif result.get("verify") == "ok" and consolidated != "equal" and not untellable:
        problems.append(f"verify passed a damaged checkpoint whose consolidation is {consolidated}")
    elif result.get("verify") == "ok" and untellable and result["kind"] == "duplicate-rank":
        # a model-states copy cannot be told from ranks with the same buffers: verify must say so
        if not any("cannot tell whether one rank's file was copied" in note for note in result.get("verify_notes", [])):
            problems.append(f"verify does not note identical rank files: {result.get('verify_notes')}")
    if result.get("torch_reads") is False:  # bytes zckpt does not need, but torch.load (DeepSpeed) does
        problems.append("verify passed a file that torch's own zip reader refuses")
    if result["kind"] == "crafted-name":
        if result.get("to_universal") != "error":  # every crafted name is refused where names become paths
            problems.append(f"to_universal: {result.get('to_universal')}: {result.get('to_universal_detail')}")
        if result.get("reshard") not in ("error", "ok"):
            problems.append(f"reshard: {result.get('reshard')}: {result.get('reshard_detail')}")
        if result.get("escaped"):
            problems.append(f"written or changed outside the output folders: {result['escaped']}")
    return problems


def outcome_of(result: dict) -> str:
    if failures_of(result):
        return "FAILED"
    if result["kind"] == "flip-swap-file" and (result["consolidate"] == "wrong" or result["verify"] == "ok"):
        return "swap-file damage: undetectable (verify notes it)"
    if result.get("untellable") and result["consolidate"] == "wrong":
        return f"untellable ({result['untellable']}), verify {'passed' if result['verify'] == 'ok' else 'found it'}"
    verdict = {"ok": "verify passed", "problems": "verify found it"}[result["verify"]]
    return f"consolidate {result['consolidate']}, {verdict}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_fuzz(pool: Pool, tmp_path: Path, kind: str) -> None:
    cases = [
        {"kind": kind, "sample": name, "seed": seed, "tmp": str(tmp_path)}
        for name in SAMPLES
        if kind != "flip-swap-file" or "nvme" in name
        for seed in range(SCALE * (1 if "nvme" in name and kind != "flip-swap-file" else KINDS[kind]))
    ]
    with ThreadPoolExecutor(WORKERS) as threads:
        results = list(threads.map(pool.run, cases))
    RESULTS[kind] = results
    failed = [
        (r["sample"], r["seed"], r.get("victim"), r.get("what"), failures_of(r)) for r in results if failures_of(r)
    ]
    assert not failed, "\n".join(map(str, failed))


def test_zz_fuzz_counts() -> None:
    """The cases of each kind and their outcomes (printed with `pytest -s`); runs last here."""
    total = 0
    for kind, results in RESULTS.items():
        outcomes = collections.Counter(outcome_of(r) for r in results)
        seconds = max((sum(r.get("seconds", {}).values()) for r in results), default=0)
        print(
            f"{kind:20} {len(results):4} cases, slowest {seconds:.2f} s: "
            + "; ".join(f"{o} {n}" for o, n in sorted(outcomes.items()))
        )
        total += len(results)
    print("fuzz cases:", total)
