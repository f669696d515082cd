"""JobSync without torch: barriers fed by a fake collective (the torchrun runs are in test_nodes.py)."""

from __future__ import annotations

import pytest

from zckpt.io.jobs import _FAILED, _GO, JobFailed, JobSync


def test_a_collective_failing_because_a_process_is_gone_is_the_jobs_failure() -> None:
    """gloo raises a RuntimeError ("Connection closed by peer") when a process of the job was
    killed: the barrier raises JobFailed naming the output, and no further collective is tried
    (its peers are gone)."""
    calls = []

    def max_of(value: int) -> int:
        calls.append(value)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46272")

    sync = JobSync(max_of, "/out", lambda value: [value, value], 0, 2)
    with pytest.raises(JobFailed, match="^/out: another process of this job stopped answering"):
        sync()
    sync.fail()
    assert calls == [_GO]
    gathering = JobSync(max_of, "/out", lambda value: max_of(value), 1, 2)
    with pytest.raises(JobFailed, match="stopped answering"):
        gathering.gather("mine")
    gathering.fail()
    assert calls == [_GO, "mine"]


def test_a_process_that_says_it_failed_is_heard_in_the_barrier() -> None:
    sync = JobSync(lambda value: max(value, _FAILED), "/out", None, 1, 2)
    with pytest.raises(JobFailed, match="failed \\(its own error says why\\)"):
        sync()
