"""Issue 37: a fault inside an elastic recovery costs one more in-process regroup, not the job.

Three workers of the scheduler/worker launch over Gloo train
tests/multiproc/ft_train.py ``--mode elastic`` (a save every 5 steps,
``--mask-padding``), with ``HVDKIT_MIN_WORKERS=1``. Rank 2 kills its worker
inside step 12, so the two others regroup into round 1 from step 10; a
trap of the phase hook (:mod:`hvdkit._phases`) aims a second fault into that
recovery:

* ``rollback``: rank 1 of round 1 pauses just before the rollback broadcast
  and the test kills its worker: rank 0's broadcast fails (before issue 37,
  its ``CollectiveError`` ended the process);
* ``init``: rank 1 of round 1 freezes (SIGSTOP) after the ready/go meeting,
  as Horovod starts: rank 0's Gloo start fails (before, Horovod 0.28.1
  aborted the process; hvdkit's patch makes it an exception), and the frozen
  rank's worker kills it at the stall timeout.

Either way rank 0 must stay in its process, regroup once more (round 2,
alone) and finish; its worlds are (3 ranks from step 0, 1 rank from step
10), replayed without faults (one job per world): equal final weights bit
for bit, and every sample of every epoch trained exactly once in both.

A third test aims a SIGKILL and a freeze at the job's very first start (round
0, no regroup before it): the two others, inside their script's
``hvdkit.init()``, meet round 1 in their processes.

A fourth (2 workers) holds one rank in its own code while the other waits in a
collective: the waiting rank's worker kills it as stuck, a lost rank the job
goes on without, not a preemption.

No test bounds wall-clock time; the freeze's time to train again is printed
(``-s``) for docs/fault-tolerance.md.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from test_elastic_mp import (
    HANG,
    final_weights,
    records,
    replay_worlds,
    start_job,
    trained_ids,
)

SAMPLES, EPOCHS, CRASH, LAST_SAVE = 96, 3, 12, 10
WORLDS = [(0, 3), (LAST_SAVE, 1)]  # (first step, ranks) of each world that trained
AGAIN = re.compile(r"round (\d+): (\d+) ranks train again from step (\d+)")


def start_faulty(root: Path, trap: dict, **settings: str):
    """The job above with ``trap`` set in its phase hook's folder; the job, its output, the hook."""
    hook = root / "hook"
    hook.mkdir(parents=True)
    (hook / "trap").write_text(json.dumps(trap))
    crash = ["--crash-at", str(CRASH), "--crash-rank", "2", "--crash-how", "worker"]
    job, out = start_job(
        root,
        *crash,
        "--mask-padding",
        HVDKIT_ELASTIC="1",
        HVDKIT_MIN_WORKERS="1",
        HVDKIT_MAX_RESTARTS="0",
        HVDKIT_PHASE_HOOK=str(hook),
        **settings,
    )
    return job, out, hook


def wait_for_hit(job, hook: Path) -> dict:
    deadline = time.monotonic() + HANG
    while not (hook / "hit").exists():
        if job.procs["scheduler"].poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the trap never fired:\n{job._everyone()}")
        time.sleep(0.05)
    return json.loads((hook / "hit").read_text())


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def gone_or_zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended (or is a zombie waiting to be reaped)."""
    try:
        return stat_fields(pid)[0] == "Z"
    except OSError:
        return True


def parent_of(pid: int) -> int:
    return int(stat_fields(pid)[1])


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> tuple[np.ndarray, dict]:
    """WORLDS without faults, each from the checkpoint the one before stopped at."""
    root = tmp_path_factory.mktemp("replay")
    ckpt, outs = root / "ckpt", []
    for i, ((start, size), (stop, _)) in enumerate(
        zip(WORLDS, [*WORLDS[1:], (None, 0)], strict=True)
    ):
        extra = ["--ckpt", str(ckpt), "--mask-padding"]
        extra += [] if stop is None else ["--stop-at", str(stop)]
        job, out = start_job(root / f"w{i}", *extra, workers=size, HVDKIT_MIN_WORKERS=str(size))
        done = job.finish()
        assert done["scheduler"][0] == 0, done["scheduler"][1][-3000:]
        assert records(out / "ids-a0-r0.jsonl")[0] == {"resumed_from": start, "size": size}
        outs.append(out)
    ids: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for out in outs:
        for epoch, counts in trained_ids(out).items():
            ids[epoch] += counts
    (weights,) = final_weights(outs[-1])
    return weights, dict(ids)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[np.ndarray]:
    """The final weights of a fault-free job of 2 ranks (each rank's)."""
    (ref,) = replay_worlds(tmp_path_factory.mktemp("two-ranks"), [(0, 2)], SAMPLES, EPOCHS)
    return final_weights(ref)


def check_one_more_regroup(result: dict, out: Path, hit: dict, replay) -> None:
    """Rank 0 finished alone in its first process, as the replay of WORLDS did."""
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())
    sched = result["scheduler"][1]
    assert result["scheduler"][0] == 0, report
    assert (hit["rank"], hit["size"], hit["round"]) == (1, 2, 1), hit
    changes = {int(r): (int(s), int(n)) for r, n, s in AGAIN.findall(sched)}
    assert changes == {2: WORLDS[1]}, (changes, report)  # round 1 never trained
    # One process trained from the start to the end: its first file, no other attempt.
    assert sorted(p.name for p in out.glob("result-*")) == ["result-a0-r0.json"], report
    assert not list(out.glob("ids-a1-*")) and not list(out.glob("ids-a2-*")), report
    rows = records(out / "ids-a0-r0.jsonl")
    marks = [
        (r["recovered_from"], r["size"], r["rank"], r["round"]) for r in rows[1:] if "size" in r
    ]
    assert rows[0] == {"resumed_from": 0, "size": 3}, rows[0]
    assert marks == [(LAST_SAVE, 1, 0, 2)], marks
    weights, ref_ids = replay
    (mine,) = final_weights(out)
    np.testing.assert_array_equal(mine, weights)
    ids = trained_ids(out)
    assert sorted(ids) == sorted(ref_ids) == list(range(EPOCHS))
    for epoch, counts in ids.items():
        assert counts == collections.Counter(range(SAMPLES)) == ref_ids[epoch], (epoch, counts)


def test_a_worker_lost_during_the_rollback_broadcast_costs_one_more_regroup(tmp_path, replay):
    job, out, hook = start_faulty(
        tmp_path / "job", {"phase": "rollback", "action": "pause", "rank": 1}
    )
    hit = wait_for_hit(job, hook)
    os.kill(parent_of(hit["pid"]), signal.SIGKILL)  # its worker; the rank dies with it
    result = job.finish()
    check_one_more_regroup(result, out, hit, replay)
    said = "".join(job.lines[n][-1] for n in job.lines if job.lines[n])
    rank0 = "".join(ln for n in job.lines for ln in job.lines[n] if "rank 0 of " in ln)
    assert "a peer was lost during round 1's roll back" in rank0, said
    assert "1 more regroup(s) for a peer lost meanwhile" in rank0, rank0


def test_a_rank_frozen_as_horovod_starts_costs_one_more_regroup(tmp_path, replay):
    stall = 8.0  # the chaos benchmark's
    job, out, hook = start_faulty(
        tmp_path / "job",
        {"phase": "init", "action": "stop", "rank": 1, "after": 1},  # its second start
        HVDKIT_STALL_TIMEOUT=str(stall),
    )
    hit = wait_for_hit(job, hook)
    result = job.finish()
    check_one_more_regroup(result, out, hit, replay)
    everyone = "".join(ln for n in job.lines for ln in job.lines[n])
    assert "Horovod could not start in round 1" in everyone, everyone[-3000:]
    assert "stalled" in result["scheduler"][1], result["scheduler"][1][-3000:]
    rows = records(out / "ids-a0-r0.jsonl")[1:]
    again = min(r["t"] for r in rows if "ids" in r and r["round"] == 2)
    print(
        f"\nfrozen at Horovod's start: rank 0 trained again {again - hit['at']:.2f} s after "
        f"the freeze (stall timeout {stall:g} s + 3 s = {stall + 3:g} s)"
    )


@pytest.mark.parametrize("how", ["kill", "stop", "lost"])
def test_a_rank_killed_or_frozen_as_the_job_first_starts_costs_one_regroup(
    tmp_path, how, two_ranks
):
    """Round 0, the job's first start: rank 1 dies (or freezes, and its worker stops it
    at the stall timeout: its heartbeat began before Horovod's start; or its worker is
    killed, and the rank with it) as Horovod starts, before any round trained. The two
    others, still inside their script's ``hvdkit.init()``, meet round 1 in their
    processes and train the whole job on 2 ranks (no return: the faulty rank's worker
    has no budget for one). One "go on
    in-process", no whole-job restart; exit 0, every sample of every epoch once, and
    final weights equal to a fault-free job of 2 ranks. With the rank frozen, both
    others' starts fail in the wait for every rank before any Gloo pair connects
    (through hvdkit's rendezvous server the mesh read of hvdkit's Horovod patch
    ``gloo-batched-mesh``, with the message of ``gloo-all-here-before-connect``)."""
    root = tmp_path / "job"
    hook = root / "hook"
    hook.mkdir(parents=True)
    action = "pause" if how == "lost" else how
    (hook / "trap").write_text(json.dumps({"phase": "init", "action": action, "rank": 1}))
    job, out = start_job(
        root,
        "--mask-padding",
        samples=SAMPLES,
        epochs=EPOCHS,
        HVDKIT_ELASTIC="1",
        HVDKIT_MAX_RESTARTS="0",
        HVDKIT_PHASE_HOOK=str(hook),
        HVDKIT_STALL_TIMEOUT="8",  # the frozen rank's worker kills it then
    )
    hit = wait_for_hit(job, hook)
    if how == "lost":  # the paused rank dies with its worker (its parent-death signal)
        os.kill(hit["worker"], signal.SIGKILL)
        deadline = time.monotonic() + HANG
        while not gone_or_zombie(hit["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        (hook / f"release.{hit['pid']}").touch()  # (never needed if it died)
    result = job.finish()
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())
    sched = result["scheduler"][1]
    assert result["scheduler"][0] == 0, report
    assert (hit["rank"], hit["size"], hit["round"]) == (1, 3, 0), hit
    assert "2 of 3 workers go on in-process as round 1" in sched, report
    assert sched.count("go on in-process as round") == 1, report
    assert not re.search(r"scheduler: restart \d+/", sched), report
    everyone = "".join(ln for n in job.lines for ln in job.lines[n])
    assert everyone.count("Horovod could not start in round 0") == 2, everyone[-3000:]
    # A freeze outlasts the rendezvous's 5 s: both others give up in the wait for
    # every rank (not one of them in a pair's connect, five times as long). A dead
    # rank's (or worker's) round ends sooner: its rendezvous server is gone, which
    # ends any wait, the unpatched Gloo's too (or its 5 s come first, on a slow machine).
    all_here = "rank 1 did not come to the rendezvous within 5 seconds"
    gone = "Horovod could not be initialized: HTTP request failed"
    failed = [ln for ln in everyone.splitlines() if "could not be initialized" in ln]
    assert len(failed) == 2, failed
    assert all(all_here in ln or (how != "stop" and gone in ln) for ln in failed), failed
    # Two programs trained, from round 1 (no return was allowed: a survivor whose
    # program had died would have ended the job non-zero).
    files = sorted(p.name for p in out.glob("ids-*"))
    assert files == ["ids-a1-r0.jsonl", "ids-a1-r1.jsonl"], files
    firsts = [records(out / name)[0] for name in files]
    assert firsts == [{"resumed_from": 0, "size": 2}] * 2, (files, firsts)
    job_w, ref_w = final_weights(out), two_ranks
    assert len(job_w) == len(ref_w) == 2, (len(job_w), len(ref_w))
    for w in job_w + ref_w[1:]:
        np.testing.assert_array_equal(w, ref_w[0])
    ids = trained_ids(out)
    assert sorted(ids) == list(range(EPOCHS)), sorted(ids)
    for epoch, counts in ids.items():
        assert counts == collections.Counter(range(SAMPLES)), (epoch, counts)


def test_a_rank_its_worker_finds_stuck_is_killed_a_lost_rank_not_a_preemption(tmp_path):
    """Rank 1 of 2 pauses rank-locally at a step (the phase hook's ``pause``: its heartbeats
    go on) while rank 0 waits for it in a collective. Rank 0's worker finds rank 0 stuck
    after twice the stall timeout (+ 5 s), kills it outright (a SIGTERM would ask it for a
    preemption) and reports it stuck: a lost rank, so rank 1 goes on alone in-process as
    round 1 once released (the test releases it after the scheduler took the report), and
    the job ends 0, nowhere "preempted", every sample of every epoch trained once. The
    killed rank's worker does not join again (``HVDKIT_MAX_RESTARTS=0``: no return)."""
    root = tmp_path / "job"
    hook = root / "hook"
    hook.mkdir(parents=True)
    (hook / "trap").write_text(json.dumps({"phase": "step", "action": "pause", "rank": 1}))
    job, out = start_job(
        root,
        "--mask-padding",
        workers=2,
        HVDKIT_ELASTIC="1",
        HVDKIT_MIN_WORKERS="1",
        HVDKIT_MAX_RESTARTS="0",
        HVDKIT_PHASE_HOOK=str(hook),
        HVDKIT_STALL_TIMEOUT="3",  # stuck after 2 * 3 + 5 s
        # Horovod's own stall shutdown (stall timeout + 10 s) stays out of the way
        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="600",
    )
    hit = wait_for_hit(job, hook)
    job.wait_for("scheduler", "1 of 2 workers go on in-process as round 1")
    (hook / f"release.{hit['pid']}").touch()
    result = job.finish()
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())
    sched = result["scheduler"][1]
    assert {n: c for n, (c, _) in result.items()} == dict.fromkeys(result, 0), report
    assert (hit["rank"], hit["size"], hit["round"]) == (1, 2, 0), hit
    assert "rank 0 ranks stuck in different collectives for more than 6 s" in sched, report
    workers = "".join(o for n, (_, o) in result.items() if n != "scheduler")
    assert "rank 0 waited in one collective too long; killing it" in workers, report
    assert "does not join again: its program came back 0 of 0 times" in sched, report
    assert "preempted" not in "".join(o for _, o in result.values()), report
    changes = {int(r): (int(s), int(n)) for r, n, s in AGAIN.findall(sched)}
    assert list(changes) == [1] and changes[1][1] == 1, (changes, report)
    assert sorted(p.name for p in out.glob("result-*")) == ["result-a0-r1.json"], report
    ids = trained_ids(out)
    assert sorted(ids) == list(range(EPOCHS)), sorted(ids)
    for epoch, counts in ids.items():
        assert counts == collections.Counter(range(SAMPLES)), (epoch, counts)
