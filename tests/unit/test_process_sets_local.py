"""Process sets in a job of one process: the same API as on 2 ranks, and its errors.

The 2-rank side (Gloo and MPI) is tests/test_process_sets_mp.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import hvdkit
from hvdkit import config


@pytest.fixture
def fresh(monkeypatch):
    """No runtime yet (each test calls init with its own process sets); shut down after."""
    for var in (*config.LAUNCHER_SIZE_VARS, config.BACKEND, config.HOROVOD_DYNAMIC_PROCESS_SETS):
        monkeypatch.delenv(var, raising=False)
    hvdkit.shutdown()
    yield monkeypatch
    hvdkit.shutdown()


def test_static_set_equal_to_the_job_is_the_global_set(fresh):
    ps = hvdkit.ProcessSet([0])
    hvdkit.init(process_sets=[ps])
    assert (ps.process_set_id, ps.rank(), ps.size(), ps.included()) == (0, 0, 1, True)
    assert hvdkit.global_process_set.ranks == [0] and hvdkit.global_process_set.size() == 1
    x = np.array([1.0, 2.0])
    assert hvdkit.allreduce(x, process_set=ps).tolist() == [1.0, 2.0]
    assert hvdkit.allgather(x, process_set=ps).tolist() == [1.0, 2.0]
    assert hvdkit.broadcast(x, 0, process_set=ps).tolist() == [1.0, 2.0]
    assert hvdkit.allgather_object("a", process_set=ps) == ["a"]
    assert int(hvdkit.size_op(ps.process_set_id)) == 1
    assert int(hvdkit.process_set_included_op(0)) == 1
    hvdkit.barrier(process_set=ps)
    assert hvdkit.remove_process_set(ps) is False  # the global set is never removed (Horovod)


def test_dynamic_sets_need_the_setting_then_add_use_remove(fresh):
    hvdkit.init()
    with pytest.raises(hvdkit.ConfigurationError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvdkit.add_process_set([0])
    hvdkit.shutdown()
    fresh.setenv(config.HOROVOD_DYNAMIC_PROCESS_SETS, "1")
    hvdkit.init()
    ps = hvdkit.add_process_set(hvdkit.ProcessSet([0]))
    assert ps.process_set_id == 0  # [0] is the whole job of one
    with pytest.raises(hvdkit.ConfigurationError, match=r"ranks \[1\] outside the job's ranks"):
        hvdkit.add_process_set([1])


def test_init_dynamic_string_allows_adding(fresh):
    hvdkit.init(process_sets="dynamic")
    assert hvdkit.add_process_set([0]).size() == 1


@pytest.mark.parametrize(
    "make, error, fragment",
    [
        (lambda: hvdkit.ProcessSet([0, 0]), hvdkit.ConfigurationError, "lists a rank twice"),
        (lambda: hvdkit.ProcessSet([0, 1.0]), hvdkit.ConfigurationError, "integer global rank"),
        (lambda: hvdkit.ProcessSet(object()), hvdkit.NotSupportedError, "list of global ranks"),
    ],
)
def test_bad_sets_are_refused_when_built(make, error, fragment):
    with pytest.raises(error, match=fragment):
        make()


@pytest.mark.parametrize(
    "sets, fragment",
    [
        ([[0], [0]], "entries 0 and 1 both hold ranks [0]"),
        ([[0, 1]], "ranks [1] outside the job's ranks [0, 1)"),
        ([[]], "has no ranks"),
        ("evens", "the string 'dynamic'"),
    ],
)
def test_bad_static_sets_are_refused_before_the_job_starts(fresh, sets, fragment):
    arg = sets if isinstance(sets, str) else [hvdkit.ProcessSet(r) for r in sets]
    with pytest.raises(hvdkit.ConfigurationError) as info:
        hvdkit.init(process_sets=arg)
    assert fragment in str(info.value)
    assert not hvdkit.is_initialized()


def test_unregistered_and_removed_sets_name_the_fix(fresh):
    fresh.setenv(config.HOROVOD_DYNAMIC_PROCESS_SETS, "1")
    hvdkit.init()
    loose = hvdkit.ProcessSet([0])
    assert (loose.size(), loose.rank()) == (None, None)  # Horovod: None until registered
    with pytest.raises(hvdkit.ConfigurationError, match="is not registered"):
        hvdkit.allreduce(np.ones(1), process_set=loose)
    with pytest.raises(hvdkit.ConfigurationError, match="process_set_id=7 is not a registered"):
        hvdkit.size_op(7)


def test_shutdown_unregisters_the_sets(fresh):
    ps = hvdkit.ProcessSet([0])
    hvdkit.init(process_sets=[ps])
    hvdkit.shutdown()
    hvdkit.init()
    assert ps.process_set_id == 0  # the global set's alias keeps meaning the whole job
