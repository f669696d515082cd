"""A finished command exits with its own code whatever signal comes after its output is complete
(issue 37): the signal is sent by the process itself, at a fixed point, so no timing is involved.

The child runs the real ``zckpt`` entry point with ``typer.echo`` wrapped: once the command's
last line is written, the wrapper sends the process SIGTERM or SIGINT (right after that line,
still inside the command; or at interpreter exit, from an atexit hook). Before the fix the first
ran the handler outside a library call (one line, exit 143/130 although the output was complete)
and the second met the default handler that Python restores while it shuts down (killed, no line).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, sample

CHILD = """
import atexit, os, signal, sys
import typer

when, signum, last = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
real_echo = typer.echo

def echo(message=None, *args, **kwargs):
    real_echo(message, *args, **kwargs)
    if str(message).startswith(last):
        if when == "after-line":
            os.kill(os.getpid(), signum)
        else:
            atexit.register(os.kill, os.getpid(), signum)

typer.echo = echo
sys.argv = ["zckpt", *sys.argv[4:]]
from zckpt.__main__ import main
main()
"""


def run_signalled(when: str, signum: str, last: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, when, signum, last, *argv],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("when", ["after-line", "at-exit"])
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_signal_after_the_success_line_exits_0(tmp_path: Path, when: str, signum: str) -> None:
    checkpoint = sample("z2_fp32_ws1").checkpoint
    done = run_signalled(when, signum, "wrote ", "consolidate", str(checkpoint), str(tmp_path / "out"))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.startswith("wrote ") and done.stderr == ""
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_signal_after_the_json_object_exits_0(tmp_path: Path) -> None:
    checkpoint = sample("z2_fp32_ws1").checkpoint
    done = run_signalled("after-line", "SIGTERM", "{", "to-dcp", str(checkpoint), str(tmp_path / "dcp"), "--json")
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert json.loads(done.stdout)["command"] == "to-dcp" and done.stderr == ""


def test_signal_after_a_no_answer_keeps_its_exit_code(tmp_path: Path) -> None:
    """inspect's 3 (incomplete) is a finished command's answer too: a later signal leaves it 3."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "latest").write_text("global_step9")
    done = run_signalled("at-exit", "SIGTERM", "", "inspect", str(folder))
    assert done.returncode in (1, 3), (done.returncode, done.stdout, done.stderr)
    assert done.returncode != 128 + signal.SIGTERM
