"""hvdkitrun's default transport: the rule docs/performance.md documents."""

from __future__ import annotations

import os
from functools import partial

import pytest

from hvdkit.launch import transport
from hvdkit.launch.transport import busy_cores, choose_transport


def local(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "me")


@pytest.mark.parametrize(
    "hosts, cores, mpi, expected, load",
    [
        # one machine, no more processes than cores, mpirun present: MPI
        ([("localhost", 2)], 2, True, "mpi", 0.0),
        ([("localhost", 1)], 2, True, "mpi", 0.0),
        ([("me", 2), ("127.0.0.1", 2)], 4, True, "mpi", 0.0),  # two names, one machine
        ([("localhost", 8)], None, True, "mpi", 0.0),  # unknown core count: not held against MPI
        # one machine, oversubscribed: Gloo
        ([("localhost", 3)], 2, True, "gloo", 0.0),
        ([("localhost", 4)], 2, True, "gloo", 0.0),
        ([("me", 2), ("localhost", 2)], 3, True, "gloo", 0.0),  # counted over every local entry
        # one machine, busy with other work (cores busy as the job starts): Gloo
        ([("localhost", 2)], 2, True, "gloo", 5.0),
        ([("localhost", 2)], 2, True, "gloo", 1.01),
        ([("localhost", 2)], 2, True, "mpi", 1.0),  # within the one core of slack
        ([("localhost", 2)], 16, True, "mpi", 12.0),  # busy, but enough free cores
        ([("localhost", 8)], None, True, "mpi", 50.0),  # unknown core count
        # more than one machine: MPI too, unless a host is oversubscribed
        ([("localhost", 1), ("b", 1)], 64, True, "mpi", 0.0),
        ([("a", 2), ("b", 2)], 64, True, "mpi", 0.0),
        ([("a", 2), ("b", 2)], 2, True, "mpi", 0.0),  # as many per host as cores
        ([("a", 2), ("b", 3)], 2, True, "gloo", 0.0),  # one host over
        ([("a", 1), ("b", 1), ("a", 2)], 2, True, "gloo", 0.0),  # a's entries add up to 3
        ([("a", 2), ("b", 2)], None, True, "mpi", 0.0),  # unknown core count
        # ... and this machine's load counts only if the job runs processes here
        ([("a", 2), ("b", 2)], 2, True, "mpi", 40.0),
        ([("localhost", 2), ("b", 2)], 2, True, "gloo", 1.5),
        ([("localhost", 2), ("b", 2)], 2, True, "mpi", 1.0),
        ([("me", 1), ("127.0.0.1", 2), ("b", 2)], 2, True, "gloo", 0.0),  # 3 here
        ([("a", 2), ("b", 2)], 64, False, "gloo", 0.0),  # no mpirun
        # no mpirun: Gloo
        ([("localhost", 2)], 2, False, "gloo", 0.0),
        ([("localhost", 1)], 64, False, "gloo", 0.0),
    ],
)
def test_rule(hosts, cores, mpi, expected, load):
    got = choose_transport(hosts, cores=cores, load=load, mpi_available=mpi, is_local=local)
    assert got == expected


@pytest.mark.parametrize(
    "hosts, cores, load",
    [
        ([("localhost", 2)], 2, 0.0),
        ([("localhost", 4)], 2, 0.0),  # oversubscribed
        ([("localhost", 2)], 2, 5.0),  # busy
        ([("a", 3), ("b", 3)], 2, 40.0),  # several machines, oversubscribed
        ([("localhost", 8)], None, 50.0),
    ],
)
def test_yielding_ranks_get_mpi_wherever_mpirun_exists(hosts, cores, load):
    pick = partial(choose_transport, hosts, cores=cores, load=load, is_local=local)
    assert pick(mpi_available=True, ranks_yield=True) == "mpi"
    assert pick(mpi_available=False, ranks_yield=True) == "gloo"


def test_ranks_yield_unless_the_environment_says_no():
    var = "OMPI_MCA_mpi_yield_when_idle"
    assert transport.ranks_yield({}) is True  # hvdkitrun's MPI_ENV
    for off in ("0", "false", "No", " n "):
        assert transport.ranks_yield({var: off}) is False, off
    for on in ("1", "true", "yes"):
        assert transport.ranks_yield({var: on}) is True, on


def test_boundary_is_processes_equal_to_cores():
    # the switch happens exactly when processes exceed cores
    picks = [
        choose_transport([("localhost", n)], cores=4, mpi_available=True, is_local=local)
        for n in range(1, 7)
    ]
    assert picks == ["mpi"] * 4 + ["gloo"] * 2


def test_load_and_processes_add_up():
    # 4 cores, 2 processes: MPI up to a load of 3 (2 + 3 = 4 + 1), Gloo above it
    picks = [
        choose_transport([("localhost", 2)], cores=4, load=x, mpi_available=True, is_local=local)
        for x in (0.0, 2.0, 3.0, 3.5, 8.0)
    ]
    assert picks == ["mpi", "mpi", "mpi", "gloo", "gloo"]


def test_answers_are_the_launcher_flags():
    # hvdkitrun turns the answer into --gloo / --mpi: only those two may come back
    assert {transport.GLOO, transport.MPI} == {"gloo", "mpi"}


def samples(*pairs):
    it = iter(pairs)
    return lambda: next(it)


def test_busy_cores_is_the_busy_share_of_the_ticks_times_the_cores():
    slept = []
    # 300 of 400 ticks busy between the two reads, on 2 cores: 1.5 cores busy
    got = busy_cores(2, 0.25, read=samples((1000, 5000), (1300, 5400)), sleep=slept.append)
    assert got == 1.5 and slept == [0.25]


@pytest.mark.parametrize(
    "cores, reads, expected",
    [
        (4, [(0, 100), (0, 200)], 0.0),  # idle
        (4, [(0, 100), (100, 200)], 4.0),  # every core busy
        (2, [None], None),  # no /proc/stat: the caller falls back to the load average
        (2, [(0, 100), None], None),
        (2, [(0, 100), (0, 100)], None),  # no ticks elapsed: nothing measured
        (None, [(0, 100)], None),  # unknown core count
    ],
)
def test_busy_cores_edges(cores, reads, expected):
    assert busy_cores(cores, read=samples(*reads), sleep=lambda s: None) == expected


def test_busy_cores_reads_this_machine():
    got = busy_cores(os.cpu_count(), 0.05)
    assert got is not None and 0.0 <= got <= os.cpu_count()


def test_root_env_exports_is_the_shell_form_of_mpi_root_env(monkeypatch):
    """scripts/_env.sh and examples/cluster/_find_hvdkitrun.sh eval this line."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    line = transport.root_env_exports()
    assert line == "export " + " ".join(f"{k}={v}" for k, v in transport.MPI_AS_ROOT_ENV.items())
    assert set(transport.MPI_AS_ROOT_ENV) == {
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
    }
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert transport.root_env_exports() == ""
