"""Pickles are read as data: a corpus of attacks is refused, real-world objects are read.

The attacks are real pickle bytes (hand-assembled opcodes, protocols 0 to 5, and pickles of
objects whose ``__reduce__`` is the payload) inside real torch archives. Each payload would
create a marker file; the corpus is first run through the standard unpickler in a child
process to prove that the live ones do create it, then through zckpt's reader and every command
that reads pickles, after which the marker must not exist.

The objects that must be read (argparse.Namespace, numpy RNG state, Megatron enums) are
written by torch.save and compared with what torch.load reads.
"""

from __future__ import annotations

import argparse
import copyreg
import enum
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from helpers import ROOT, assert_same_objects, sample
from zckpt.cli.app import app
from zckpt.core.dtypes import BY_NAME, FP32
from zckpt.core.errors import CorruptFileError, UnsafePickleError
from zckpt.io.reading import FileReader, read_ref
from zckpt.torchfile import reader as torchfile
from zckpt.torchfile.legacy import LEGACY_MAGIC

try:  # click < 8.2 mixes stderr into output unless told not to; 8.2 always keeps it apart
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()

# ---------------------------------------------------------------------------------------------
# Opcode helpers (protocol 2 unless said otherwise)


def g(module: str, name: str) -> bytes:
    """GLOBAL module name."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def u(text: str) -> bytes:
    """BINUNICODE text."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def su(text: str) -> bytes:
    """SHORT_BINUNICODE text (protocol 4)."""
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def t(*items: bytes) -> bytes:
    """MARK items TUPLE."""
    return b"(" + b"".join(items) + b"t"


def lst(*items: bytes) -> bytes:
    """EMPTY_LIST MARK items APPENDS."""
    return b"](" + b"".join(items) + b"e"


def d(*pairs: tuple[bytes, bytes]) -> bytes:
    """EMPTY_DICT MARK key value ... SETITEMS."""
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def call(func: bytes, *args: bytes) -> bytes:
    """func(*args) with REDUCE."""
    return func + t(*args) + b"R"


def p2(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def p4(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def shell(marker: str) -> str:
    return f"touch {marker}"


def python_code(marker: str) -> str:
    return f"open({marker!r}, 'w').close()"


class _Reduces:
    """An object whose pickle is `function(*args)`: what stdlib pickling of a payload looks like."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple:
        return (self.function, self.args)


OS_SYSTEM = f"{os.system.__module__}.system"  # how pickle names os.system here (posix.system)
EXT_CODE = 0x7AB0  # a copyreg extension code registered (to os.system) only around the EXT tests


@dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[str], bytes]  # marker path -> data.pkl bytes
    culprit: str  # what the refusal must name
    live: bool = True  # the standard unpickler runs it (checked in a child process)
    error: type = UnsafePickleError
    needs_extension: bool = False


def _nested(marker: str) -> bytes:
    tree = {"module": {"w": [1, 2]}, "client": [{"deep": (0, [OrderedDict(x=_Reduces(os.system, shell(marker)))])}]}
    return pickle.dumps(tree, protocol=2)


EXTRA_STORAGE = "attack"  # a two-float storage record replace_pickle adds to every archive


def _tensor_then_build(marker: str) -> bytes:
    """A sound tensor, then BUILD pointing it at another file (data exfiltration)."""
    storage = t(u("storage"), g("torch", "FloatStorage"), u(EXTRA_STORAGE), u("cpu"), b"K\x02") + b"Q"
    tensor = call(
        g("torch._utils", "_rebuild_tensor_v2"),
        storage,
        b"K\x00",
        t(b"K\x02"),
        t(b"K\x01"),
        b"\x89",
        call(g("collections", "OrderedDict")),
    )
    return p2(tensor + t(u("/etc/passwd"), b"K\x00", b"N", b"N", b"N") + b"b")


def _computed_stack_global(marker: str) -> bytes:
    # The names are list items first, fetched back from the memo: no GLOBAL line names os.system.
    names = b"]\x94(" + su("os") + b"\x94" + su("system") + b"\x94e0"  # list ["os", "system"], memo 1 and 2, popped
    return p4(names + b"h\x01h\x02\x93" + t(su(shell(marker))) + b"R")


ATTACKS = [
    Attack("reduce os.system", lambda m: p2(call(g("os", "system"), u(shell(m)))), "os.system"),
    Attack("reduce posix.system", lambda m: p2(call(g("posix", "system"), u(shell(m)))), "posix.system"),
    Attack("reduce nt.system", lambda m: p2(call(g("nt", "system"), u(shell(m)))), "nt.system", live=False),
    Attack("reduce eval", lambda m: p2(call(g("builtins", "eval"), u(python_code(m)))), "builtins.eval"),
    Attack("reduce exec", lambda m: p2(call(g("builtins", "exec"), u(python_code(m)))), "builtins.exec"),
    Attack(
        "protocol 0, Python 2 name",
        lambda m: b"c__builtin__\neval\n(V" + python_code(m).encode() + b"\ntR.",
        "builtins.eval",
    ),
    Attack(
        "getattr(__import__('os'), 'system')",
        lambda m: p2(
            call(call(g("builtins", "getattr"), call(g("builtins", "__import__"), u("os")), u("system")), u(shell(m)))
        ),
        "builtins.__import__",
    ),
    Attack(
        "getattr on an allowlisted global",
        lambda m: p2(call(g("builtins", "getattr"), g("collections", "OrderedDict"), u("fromkeys"))),
        "builtins.getattr",
        live=False,
    ),
    Attack("subprocess.Popen", lambda m: p2(call(g("subprocess", "Popen"), lst(u("touch"), u(m)))), "subprocess.Popen"),
    Attack(
        "subprocess.check_output",
        lambda m: p2(call(g("subprocess", "check_output"), lst(u("touch"), u(m)))),
        "subprocess.check_output",
    ),
    Attack(
        "functools.partial, called",
        lambda m: p2(call(call(g("functools", "partial"), g("os", "system"), u(shell(m))))),
        "functools.partial",
    ),
    Attack(
        "functools.partial by NEWOBJ + BUILD, called",
        lambda m: p2(
            g("functools", "partial")
            + t(g("os", "system"))
            + b"\x81"
            + t(g("os", "system"), t(u(shell(m))), b"}", b"N")
            + b"b)R"
        ),
        "functools.partial",
    ),
    Attack(
        "operator.attrgetter",
        lambda m: p2(
            call(
                call(call(g("operator", "attrgetter"), u("system")), call(g("builtins", "__import__"), u("os"))),
                u(shell(m)),
            )
        ),
        "operator.attrgetter",
    ),
    Attack("torch.load", lambda m: p2(call(g("torch", "load"), u("/nonexistent/evil.pt"))), "torch.load", live=False),
    Attack(
        "pickle.loads of a nested pickle",
        lambda m: p2(
            call(
                g("pickle", "loads"),
                call(g("_codecs", "encode"), u(p2(call(g("os", "system"), u(shell(m)))).decode("latin1")), u("latin1")),
            )
        ),
        "pickle.loads",
    ),
    Attack("nested deep inside dicts and lists", _nested, OS_SYSTEM),
    Attack("result discarded (POP)", lambda m: p2(call(g("os", "system"), u(shell(m))) + b"0}"), "os.system"),
    Attack(
        "inside an allowlisted call's arguments",
        lambda m: p2(call(g("collections", "OrderedDict"), lst(t(u("k"), call(g("os", "system"), u(shell(m))))))),
        "os.system",
    ),
    Attack(
        "protocol 5 with frames", lambda m: pickle.dumps({"x": _Reduces(os.system, shell(m))}, protocol=5), OS_SYSTEM
    ),
    *(
        Attack(
            f"protocol {p} from pickle.dumps",
            lambda m, p=p: pickle.dumps([_Reduces(os.system, shell(m))], protocol=p),
            OS_SYSTEM,
        )
        for p in (0, 1, 3, 4)
    ),
    # persistent ids: what torch.load's own persistent_load would see
    Attack(
        "payload inside a storage record",
        lambda m: p2(t(u("storage"), call(g("os", "system"), u(shell(m))), u("0"), u("cpu"), b"K\x02") + b"Q"),
        "os.system",
    ),
    Attack(
        "callable as a storage type",
        lambda m: p2(t(u("storage"), g("os", "system"), u("0"), u("cpu"), b"K\x02") + b"Q"),
        "os.system",
        live=False,
    ),
    Attack(
        "non-storage persistent id", lambda m: p2(t(g("os", "system"), u(shell(m))) + b"Q"), "os.system", live=False
    ),
    Attack(
        "protocol 0 string persistent id",
        lambda m: b"Pos.system\n.",
        "persistent id",
        live=False,
        error=CorruptFileError,
    ),
    # BUILD: __setstate__ of the real class never runs; state cannot arm the next BUILD
    Attack(
        "BUILD sets __setstate__, then BUILD again",
        lambda m: p2(
            g("argparse", "Namespace")
            + b")\x81"
            + d((u("__setstate__"), g("os", "system")))
            + b"b"
            + u(shell(m))
            + b"b"
        ),
        "os.system",
    ),
    Attack(
        "BUILD sets __reduce__",
        lambda m: p2(g("argparse", "Namespace") + b")\x81" + d((u("__reduce__"), g("os", "system"))) + b"b"),
        "os.system",
        live=False,
    ),
    Attack(
        "BUILD with slot state on a class",
        lambda m: p2(g("argparse", "Namespace") + t(b"N", d((u("__eq__"), g("os", "system")))) + b"b"),
        "argparse.Namespace",
        live=False,
    ),
    Attack(
        "BUILD on an allowlisted global",
        lambda m: p2(g("collections", "OrderedDict") + t(b"N", d((u("function"), g("os", "system")))) + b"b"),
        "collections.OrderedDict",
        live=False,
    ),
    Attack("BUILD repoints a tensor at another file", _tensor_then_build, "tensor", live=False, error=CorruptFileError),
    Attack(
        "BUILD rewrites torch.float32",
        lambda m: p2(g("torch", "float32") + d((u("itemsize"), b"K\x01")) + b"b"),
        "float32",
        live=False,
        error=CorruptFileError,
    ),
    Attack(
        "OrderedDict attribute hides a method",
        lambda m: p2(call(g("collections", "OrderedDict")) + d((u("items"), b"]")) + b"b"),
        "items",
        live=False,
        error=CorruptFileError,
    ),
    # other ways to call
    Attack("INST opcode", lambda m: b"(V" + shell(m).encode() + b"\nios\nsystem\n.", "os.system"),
    Attack("INST opcode without arguments", lambda m: b"(ios\nsystem\n.", "os.system", live=False),
    Attack("OBJ opcode", lambda m: p2(b"(" + g("os", "system") + u(shell(m)) + b"o"), "os.system"),
    Attack(
        "NEWOBJ_EX functools.partial, called",
        lambda m: p4(g("functools", "partial") + t(g("os", "system"), u(shell(m))) + b"}\x92)R"),
        "functools.partial",
    ),
    Attack("STACK_GLOBAL with names from the memo", _computed_stack_global, "os.system"),
    Attack(
        "STACK_GLOBAL with a dotted name",
        lambda m: p4(su("os") + su("path.os.system") + b"\x93" + t(su(shell(m))) + b"R"),
        "os.path.os.system",
    ),
    Attack(
        "EXT opcode, registered extension",
        lambda m: p2(b"\x83" + struct.pack("<H", EXT_CODE) + t(u(shell(m))) + b"R"),
        "os.system",
        needs_extension=True,
    ),
    Attack(
        "EXT opcode, no registry", lambda m: p2(b"\x82\x05" + t(u(shell(m))) + b"R"), "extension registry", live=False
    ),
    Attack(
        "copyreg._reconstructor with a callable base",
        lambda m: p2(
            call(
                g("copyreg", "_reconstructor"),
                g("subprocess", "Popen"),
                g("subprocess", "Popen"),
                lst(u("touch"), u(m)),
            )
        ),
        "subprocess.Popen",
    ),
    Attack(
        "torch _rebuild_from_type_v2 calling os.system",
        lambda m: p2(
            call(
                g("torch._tensor", "_rebuild_from_type_v2"),
                g("os", "system"),
                g("torch", "Tensor"),
                t(u(shell(m))),
                b"}",
            )
        ),
        "os.system",
    ),
    Attack(
        "numpy object dtype", lambda m: p2(call(g("numpy", "dtype"), u("O8"), b"\x89", b"\x88")), "'O8'", live=False
    ),
    Attack(
        "numpy RandomState constructor",
        lambda m: p2(call(g("numpy.random._pickle", "__randomstate_ctor"), u("MT19937"))),
        "numpy.random._pickle.__randomstate_ctor",
        live=False,
    ),
]


def _benign_archive(path: Path) -> Path:
    torch.save({"w": torch.ones(2)}, path)
    return path


def replace_pickle(archive: Path, data: bytes, target: Path) -> Path:
    """Copy a torch archive with its data.pkl record replaced (records and CRCs otherwise real),
    plus a storage record EXTRA_STORAGE of two floats."""
    with zipfile.ZipFile(archive) as source:
        records = [(info.filename, source.read(info)) for info in source.infolist()]
    prefix = records[0][0].split("/")[0]
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as out:
        for name, content in records + [(f"{prefix}/data/{EXTRA_STORAGE}", struct.pack("<2f", 1, 2))]:
            out.writestr(name, data if name.endswith("/data.pkl") else content)
    return target


def as_legacy(data: bytes, target: Path) -> Path:
    """The pickle `data` as the main pickle of a legacy (non-zip) torch.save file, as DeepSpeed
    writes with checkpoint_serialization false: the zip format's storage records get the legacy
    sixth item (view_metadata None), and EXTRA_STORAGE is stored where the pickle uses it."""
    data = data.replace(u("cpu") + b"K\x02t", u("cpu") + b"K\x02Nt")
    keys = [EXTRA_STORAGE] if u(EXTRA_STORAGE) in data else []
    head = b"".join(pickle.dumps(x, protocol=2) for x in (LEGACY_MAGIC, 1001, LEGACY_SYS_INFO))
    storages = b"".join(struct.pack("<q2f", 2, 1, 2) for _ in keys)
    target.write_bytes(head + data + pickle.dumps(keys, protocol=2) + storages)
    return target


LEGACY_SYS_INFO = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}


@pytest.fixture
def extension_registered():
    copyreg.add_extension("os", "system", EXT_CODE)
    try:
        yield
    finally:
        copyreg.remove_extension("os", "system", EXT_CODE)


def _setup(attack: Attack, request: pytest.FixtureRequest) -> None:
    if attack.needs_extension:
        request.getfixturevalue("extension_registered")


# ---------------------------------------------------------------------------------------------
# The corpus is live


@pytest.mark.slow
def test_live_attacks_do_run_under_the_standard_unpickler(tmp_path: Path) -> None:
    """Proof that the markers would appear: the plain unpickler (as torch.load(weights_only=False)
    uses) runs each live payload in a child process."""
    cases = {
        a.name: (a.build(str(tmp_path / f"live-{i}")).hex(), str(tmp_path / f"live-{i}"), a.needs_extension)
        for i, a in enumerate(ATTACKS)
        if a.live
    }
    script = (
        "import copyreg, json, pickle, sys\n"
        f"copyreg.add_extension('os', 'system', {EXT_CODE})\n"
        "for name, (data, marker, _) in json.loads(sys.stdin.read()).items():\n"
        "    try:\n"
        "        pickle.loads(bytes.fromhex(data))\n"
        "    except Exception:\n"
        "        pass\n"
    )
    subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(cases),
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=True,
        capture_output=True,
    )
    assert [name for name, (_, marker, _) in cases.items() if not os.path.exists(marker)] == []


# ---------------------------------------------------------------------------------------------
# Refused by the reader


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_reader_refuses_without_running(attack: Attack, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _setup(attack, request)
    marker = tmp_path / "marker"
    evil = replace_pickle(_benign_archive(tmp_path / "ok.pt"), attack.build(str(marker)), tmp_path / "evil.pt")
    with pytest.raises(attack.error) as caught:
        torchfile.load(evil)
    message = str(caught.value)
    assert message.startswith(f"{evil}: ") and attack.culprit in message and "\n" not in message, message
    assert not marker.exists()
    assert FP32.itemsize == 4 and BY_NAME["float32"] is FP32  # nothing shared was changed


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_reader_refuses_legacy_files_without_running(
    attack: Attack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The same corpus as the main pickle of a legacy (non-zip) file: read by the same unpickler,
    refused alike (the storage sizes are taken from that pickle first, by the same rules)."""
    _setup(attack, request)
    marker = tmp_path / "marker"
    evil = as_legacy(attack.build(str(marker)), tmp_path / "evil.pt")
    with pytest.raises(attack.error) as caught:
        torchfile.load(evil)
    message = str(caught.value)
    assert message.startswith(f"{evil}: ") and attack.culprit in message and "\n" not in message, message
    assert not marker.exists()
    assert FP32.itemsize == 4 and BY_NAME["float32"] is FP32


def test_plain_unpickle_with_a_cached_extension_is_refused(extension_registered: None, tmp_path: Path) -> None:
    """Where the process's copyreg cache already holds the real os.system (another unpickler
    resolved the code), the C unpickler would take it without asking find_class: refused first."""
    pickle.loads(b"\x80\x02\x83" + struct.pack("<H", EXT_CODE) + b".")  # caches the real os.system
    assert copyreg._extension_cache  # type: ignore[attr-defined]
    marker = tmp_path / "marker"
    with pytest.raises(UnsafePickleError, match="os.system"):
        torchfile.unpickle(p2(b"\x83" + struct.pack("<H", EXT_CODE) + t(u(shell(str(marker)))) + b"R"), "mem")
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Refused by every command that reads pickles

SAMPLE = "z3_fp32_ws2_tied_frozen"
VICTIM = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _commands(checkpoint: Path, out: Path) -> dict[str, list[str]]:
    commands = {
        "consolidate": ["consolidate", str(checkpoint), str(out)],
        "inspect": ["inspect", str(checkpoint)],
        "reshard": ["reshard", str(checkpoint), str(out), "--world-size", "1"],
        "to-universal": ["to-universal", str(checkpoint), str(out)],
    }
    registered = {c.name for c in app.registered_commands} | {
        c.callback.__name__.replace("_", "-") for c in app.registered_commands if c.callback
    }
    if "verify" in registered:
        commands["verify"] = ["verify", str(checkpoint)]
    if "diff" in registered:
        commands["diff"] = ["diff", str(checkpoint), str(sample(SAMPLE).checkpoint)]
    return commands


def _planted(attack: Attack, tmp_path: Path) -> Path:
    checkpoint = shutil.copytree(sample(SAMPLE).checkpoint, tmp_path / "ckpt")
    victim = checkpoint / (checkpoint / "latest").read_text().strip() / VICTIM
    replace_pickle(victim, attack.build(str(tmp_path / "marker")), tmp_path / "evil.pt")
    os.replace(tmp_path / "evil.pt", victim)
    return checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_every_command_refuses_without_running(attack: Attack, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _setup(attack, request)
    checkpoint = _planted(attack, tmp_path)
    for command, args in _commands(checkpoint, tmp_path / "out").items():
        result = runner.invoke(app, args)
        assert result.exit_code not in (0, None), (command, result.output)
        text = result.stderr + result.output if command in ("inspect", "verify") else result.stderr
        if command not in ("inspect", "verify"):
            assert len(text.strip().splitlines()) == 1 and text.startswith("zckpt: error: "), (command, text)
        assert VICTIM in text and attack.culprit in text, (command, text)
        assert not (tmp_path / "marker").exists(), command
        assert not (tmp_path / "out").exists(), command


@pytest.mark.parametrize(
    "attack", [a for a in ATTACKS if a.name in ("reduce os.system", "OBJ opcode")], ids=lambda a: a.name
)
def test_the_installed_command_line_refuses_in_one_line(attack: Attack, tmp_path: Path) -> None:
    """The same through the real entry point: one line on stderr, exit 1, no traceback."""
    checkpoint = _planted(attack, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("ZCKPT_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "zckpt", "consolidate", str(checkpoint), str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert VICTIM in result.stderr and attack.culprit in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "marker").exists() and not (tmp_path / "out").exists()


def test_a_legacy_rank_file_with_a_payload_is_refused_in_one_line(tmp_path: Path) -> None:
    """A checkpoint saved with checkpoint_serialization false, one rank file's pickle a payload."""
    attack = next(a for a in ATTACKS if a.name == "reduce os.system")
    case = sample("z2_bf16_ws2_legacy_serialization")
    checkpoint = shutil.copytree(case.checkpoint, tmp_path / "ckpt")
    victim = checkpoint / case.meta["tag"] / "mp_rank_00_model_states.pt"
    as_legacy(attack.build(str(tmp_path / "marker")), victim)
    result = runner.invoke(app, ["consolidate", str(checkpoint), str(tmp_path / "out")])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert victim.name in result.stderr and "os.system" in result.stderr, result.stderr
    assert not (tmp_path / "marker").exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Read as data


def test_instances_of_any_class_become_inert_records(tmp_path: Path) -> None:
    """argparse.Namespace, a torch module, a namedtuple and dict/list subclasses: their class
    name and everything pickle gave them, kept as data; their code never runs."""
    from collections import namedtuple

    Point = namedtuple("Point", "x y")
    module = types.ModuleType("zckpt_test_classes")
    module.Point = Point
    Point.__module__ = module.__name__

    class Items(list):
        pass

    class Table(dict):
        pass

    for cls in (Items, Table):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    sys.modules[module.__name__] = module
    try:
        state = {
            "args": argparse.Namespace(lr=0.5, layers=[1, 2]),
            "linear": torch.nn.Linear(2, 3),
            "point": Point(1, 2),
            "items": Items([3, 4]),
            "table": Table(a=5),
        }
        torch.save(state, tmp_path / "objects.pt")
    finally:
        del sys.modules[module.__name__]
    loaded = torchfile.load(tmp_path / "objects.pt")
    args = loaded["args"]
    assert isinstance(args, torchfile.PickledObject) and args.original_class == "argparse.Namespace"
    assert vars(args) == {"lr": 0.5, "layers": [1, 2]} and args.lr == 0.5
    linear = loaded["linear"]
    assert linear.original_class == "torch.nn.modules.linear.Linear"
    weight = vars(linear)["_parameters"]["weight"]
    with FileReader() as reader:
        assert np.array_equal(read_ref(reader, weight).reshape(3, 2), state["linear"].weight.detach().numpy())
    assert loaded["point"].original_class == "zckpt_test_classes.Point" and loaded["point"].pickle_args == (1, 2)
    assert loaded["items"].pickle_list_items == [3, 4] and loaded["table"].pickle_dict_items == [("a", 5)]
    with pytest.raises(UnsafePickleError, match="calls an instance of argparse.Namespace"):
        args()


def test_numpy_arrays_dtypes_and_scalars_read_as_numpy_does(tmp_path: Path) -> None:
    """torch.load is the oracle: same values, dtypes and memory order."""
    rng = np.random.default_rng(3)
    state = {
        "rng": np.random.get_state(),
        "c": rng.standard_normal((3, 4)).astype(np.float32),
        "f": np.asfortranarray(rng.integers(0, 9, (2, 5))),
        "big_endian": np.arange(4, dtype=">i4"),
        "strings": np.array(["ab", "cde"]),
        "bytes": np.array([b"x", b"yz"]),
        "bools": np.array([True, False]),
        "complex": np.array([1 + 2j], dtype=np.complex64),
        "empty": np.zeros((0, 3)),
        "scalars": [np.float64(0.25), np.int32(-3), np.bool_(True), np.float16(1.5)],
        "dtype": np.dtype(">U3"),
        "same": None,
    }
    state["same"] = state["c"]  # one array referenced twice stays one object
    torch.save(state, tmp_path / "np.pt")
    expected = torch.load(tmp_path / "np.pt", weights_only=False)
    loaded = torchfile.load(tmp_path / "np.pt")
    assert loaded["rng"][0] == expected["rng"][0] and loaded["rng"][2:] == expected["rng"][2:]
    for name in ("c", "f", "big_endian", "strings", "bytes", "bools", "complex", "empty"):
        ours, theirs = loaded[name], expected[name]
        assert type(ours) is np.ndarray and ours.dtype == theirs.dtype and np.array_equal(ours, theirs), name
        assert ours.flags.c_contiguous == theirs.flags.c_contiguous and ours.flags.writeable, name
    assert np.array_equal(loaded["rng"][1], expected["rng"][1]) and loaded["rng"][1].dtype == expected["rng"][1].dtype
    assert [(type(v), v) for v in loaded["scalars"]] == [(type(v), v) for v in expected["scalars"]]
    assert loaded["dtype"] == expected["dtype"] and loaded["same"] is loaded["c"]


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_tensors_are_refused_naming_them(layout: str, tmp_path: Path) -> None:
    """A sparse tensor (DeepSpeed ZeRO-0's SGD momentum of an nn.Embedding(sparse=True), issue 35
    item 4) is refused in one line that names it, not as an unknown global (a payload?)."""
    dense = torch.tensor([[0.0, 1.5], [2.0, 0.0]])
    torch.save(
        {"momentum_buffer": dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()}, tmp_path / "s.pt"
    )
    with pytest.raises(UnsafePickleError, match=rf"sparse tensor \(torch.{layout}; nn.Embedding\(sparse=True\)") as err:
        torchfile.load(tmp_path / "s.pt")
    assert "payload" not in str(err.value)


def test_enums_sizes_devices_and_classes_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    enums = _megatron_enums(monkeypatch)
    state = {
        "pos": enums.PositionEmbeddingType.rotary,
        "size": torch.Size([2, 3]),
        "devices": [torch.device("cpu"), torch.device("cuda", 1)],
        "class": OrderedDict,
        "fn": torch.nn.functional.gelu,
    }
    torch.save(state, tmp_path / "misc.pt")
    loaded = torchfile.load(tmp_path / "misc.pt")
    assert loaded["pos"] == torchfile.PickledEnumMember("megatron.model.enums.PositionEmbeddingType", 1)
    assert loaded["size"] == (2, 3) and isinstance(loaded["size"], torchfile.TorchSize)
    assert loaded["devices"] == ["cpu", "cuda:1"] and [d.args for d in loaded["devices"]] == [("cpu",), ("cuda", 1)]
    assert torchfile.global_name(loaded["class"]) == ("collections", "OrderedDict")  # held by name, allowlisted or not
    fn = loaded["fn"]
    assert isinstance(fn, torchfile.PickledGlobal) and torchfile.global_name(fn) == (
        torch.nn.functional.gelu.__module__,
        "gelu",
    )  # as pickle names it


def _megatron_enums(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """megatron.model.enums as Megatron-DeepSpeed defines it, importable for torch.save/load."""
    module = types.ModuleType("megatron.model.enums")

    class PositionEmbeddingType(enum.Enum):
        rotary = 1
        absolute = 2
        alibi = 3

    class AttnMaskType(enum.Enum):
        padding = 1
        causal = 2

    for cls in (PositionEmbeddingType, AttnMaskType):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    for name, value in (
        ("megatron", types.ModuleType("megatron")),
        ("megatron.model", types.ModuleType("megatron.model")),
        ("megatron.model.enums", module),
    ):
        monkeypatch.setitem(sys.modules, name, value)
    return module


# ---------------------------------------------------------------------------------------------
# A Megatron-DeepSpeed-style checkpoint: args and numpy RNG state in every model_states file


def _megatron_style(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict]:
    """A sample's model_states re-saved by torch with what Megatron-DeepSpeed adds."""
    enums = _megatron_enums(monkeypatch)
    checkpoint = shutil.copytree(sample(SAMPLE).checkpoint, tmp_path / "megatron")
    random.seed(5)
    np.random.seed(5)
    extra = {
        "args": argparse.Namespace(
            num_layers=2,
            hidden_size=8,
            params_dtype=torch.float32,
            position_embedding_type=enums.PositionEmbeddingType.absolute,
            lr=3e-4,
            data_path=["a", "b"],
            consumed_train_samples=96,
        ),
        "iteration": 3,
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "rng_tracker_states": {},
            }
        ],
        "checkpoint_version": 3.0,
    }
    tag = checkpoint / (checkpoint / "latest").read_text().strip()
    for path in sorted(tag.glob("*model_states.pt")):
        state = torch.load(path, weights_only=False)
        state.update(extra)
        torch.save(state, path)
    return checkpoint, extra


def test_megatron_style_checkpoint_consolidates_and_inspects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, _ = _megatron_style(tmp_path, monkeypatch)
    result = runner.invoke(app, ["consolidate", str(checkpoint), str(tmp_path / "out"), "--format", "torch"])
    assert result.exit_code == 0, result.stderr
    weights = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = sample(SAMPLE).expected_fp32()
    assert sorted(weights) == sorted(expected) and all(torch.equal(weights[n], expected[n]) for n in expected)
    report = runner.invoke(app, ["inspect", str(checkpoint), "--json"])
    assert report.exit_code == 0, report.output
    assert json.loads(report.stdout)["zero_stage"] == 3


def test_megatron_style_client_state_survives_reshard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """reshard writes args (a Namespace holding a dtype and an enum), the numpy and torch RNG
    states and the rest back so that torch.load gives what it gives for the input."""
    checkpoint, extra = _megatron_style(tmp_path, monkeypatch)
    result = runner.invoke(app, ["reshard", str(checkpoint), str(tmp_path / "out"), "--world-size", "1"])
    assert result.exit_code == 0, result.stderr
    original = torch.load(
        next((checkpoint / "global_step3").glob("zero_pp_rank_0_*model_states.pt")), weights_only=False
    )
    written = torch.load(
        tmp_path / "out" / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False
    )
    for key in extra:
        assert_same_objects(written[key], original[key], key)
    assert written["args"].position_embedding_type is original["args"].position_embedding_type  # the enum member itself
    assert written["args"].params_dtype is torch.float32
