"""Phase x fault: a fault aimed at a phase of an elastic job's life costs one recovery.

Three workers of the scheduler/worker launch over Gloo (``HVDKIT_ELASTIC=1``,
``HVDKIT_MIN_WORKERS=2``, a stall timeout of 6 s) train
tests/multiproc/ft_train.py ``--mode elastic`` with ``--mask-padding``. The
test aims one fault after another at the phases of :data:`hvdkit._phases.PHASES`
with the phase hooks (``HVDKIT_PHASE_HOOK``: a trap file that the first process
to enter the phase takes; no sleep decides where a fault lands):

* ``kill``: the process SIGKILLs itself; its worker starts the program again
  and it joins the job as a newcomer;
* ``stop``: it SIGSTOPs itself (frozen); its worker stops it at the stall
  timeout, then the same;
* ``lost``: it pauses in the phase, the test SIGKILLs its worker (the rank
  dies with it) and starts a new worker, which joins.

At ``word`` the process is a survivor's worker (killed, frozen: the scheduler
counts it lost after the silence limit, then the test kills it, or lost).
A fault at a phase of a regrouping (the scheduler's word, leaving, the
meeting, Horovod's init, the rollback, a newcomer's restore, re-sharding, the
first step of a world) is aimed at the regrouping in which the last fault's
newcomer joins, at one of the survivors (a pid; the newcomer for
``restore``): newcomers wait at a gate (``--join-until``) that the test
opens once the trap is set. A fault at a phase of training waits until the
world is whole again. So each job is a chain: it shrinks with each fault and
grows back with each return.

For each fault: one more "go on in-process" from the scheduler, no whole-job
restart, and the processes that were ranks before it, but the faulty one,
are the same processes after. Last, a rank killed as its training function
returns (the job's end) costs exactly one whole-job restart. For the job:
exit 0, every sample of every epoch trained exactly once, and final weights
equal, bit for bit, to a fault-free replay of its worlds (one job per world, each from the
checkpoint the one before stopped at).

The stall timeout is above Horovod's Gloo timeout in elastic jobs (5 s): with
4 s a rank frozen just before the preemption check's exchange was woken by its
worker's SIGCONT and SIGTERM while its peers still waited in that exchange,
and the whole job stopped as preempted (exit 75).

The same job then aims each kind of fault at a survivor as Horovod starts and
before the rollback broadcast of a world a newcomer joins: the newcomer's own
start (its script's ``hvdkit.init()``) or ``restore()`` fails then, outside
``elastic.run``, and it too must meet the next world in its process. (One job
for all of it: each job of this file costs a fault-free replay of every world
it trained in, one launched job per world.)

No test bounds wall-clock time: the waits' deadlines only turn a hang into a
failure.
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
import psutil
from test_elastic_mp import (
    HANG,
    WORKERS_SH,
    final_weights,
    replay_worlds,
    start_job,
    trained_ids,
)

SAMPLES, EPOCHS, WORKERS = 48, 100, 3  # 4 steps per epoch on 3 workers, 6 on 2
# (the faults end by about step 120 of the 400 or more: the rest trains unpaced, and the
# replay trains it again)
STALL_S = "6"  # above Horovod's Gloo timeout in elastic jobs (5 s): see the limits in the docs
# Phases only a regrouping passes through: their traps wait for the next newcomer.
REGROUPING = ("word", "leave", "meet", "init", "rollback", "restore", "reshard", "first_step")
# ...and of those, the ones a survivor passes (its pid is aimed at; "word": its worker's).
SURVIVORS = ("word", "leave", "meet", "init", "rollback", "reshard", "first_step")
AGAIN = "ranks train again from step"
LOST_ROUND = "go on in-process as round"
RESTART = r"scheduler: restart \d+/"
PAUSED = ("lost", "cut")  # kinds of fault the test acts out while the process waits in the phase
CELL_LIMIT_S = 300  # a wait of the chain longer than this is a failure (a hang), not a slow cell


class ChainBroken(AssertionError):
    """The job ended, or said nothing awaited within the chain's limit."""


class Chain:
    """One elastic job, and the faults the test aims at its phases one after another."""

    def __init__(self, root: Path, limit_s: float = HANG, where=None, **settings: str):
        self.limit_s = limit_s
        self.traps = root / "traps"
        self.traps.mkdir(parents=True)
        self.gate, self.pace = root / "gate", root / "pace"
        self.pace.touch()
        self.job, self.out = start_job(
            root,
            "--mask-padding",
            "--step-sleep",
            "0.25",
            "--sleep-while",
            str(self.pace),
            "--join-until",
            str(self.gate),
            workers=WORKERS,
            samples=SAMPLES,
            epochs=EPOCHS,
            where=where,
            HVDKIT_ELASTIC="1",
            HVDKIT_MAX_RESTARTS="40",  # a worker whose program died starts it again
            HVDKIT_STALL_TIMEOUT=STALL_S,
            HVDKIT_PHASE_HOOK=str(self.traps),
            **settings,
        )
        self.new_workers = 0
        self.cells: list[dict] = []

    # ------------------------------------------------------------ the job's processes
    def ranks(self) -> dict[int, Path]:
        """The job's rank processes that train (running, their steps file open): pid -> file."""
        found = {}
        for proc in psutil.process_iter(["cmdline", "status"]):
            cmd = proc.info["cmdline"] or []
            if not any(a.endswith("ft_train.py") for a in cmd) or str(self.out) not in cmd:
                continue
            if proc.info["status"] in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                continue
            try:
                files = [Path(f.path) for f in proc.open_files()]
            except psutil.Error:
                continue
            ids = [f for f in files if f.parent == self.out and f.name.startswith("ids-")]
            if ids:  # (a newcomer at the gate has not started Horovod, nor opened it)
                found[proc.pid] = ids[0]
        return found

    def log(self) -> str:
        return self.job.output("scheduler")

    def wait(self, mark: int, *patterns: str) -> re.Match:
        """The first match, after ``mark`` in the scheduler's log, of any of ``patterns``.

        Raises:
            ChainBroken: the scheduler ended first, or ``limit_s`` passed.
        """
        deadline = time.monotonic() + self.limit_s
        while True:
            text = self.log()[mark:]
            found = [m for m in (re.search(p, text) for p in patterns) if m]
            if found:
                return min(found, key=lambda m: m.start())
            if self.job.procs["scheduler"].poll() is not None or time.monotonic() > deadline:
                raise ChainBroken(f"the scheduler never said any of {patterns}:\n{text[-4000:]}")
            time.sleep(0.1)

    # ------------------------------------------------------------ one cell
    def fault(self, phase: str, how: str) -> dict:
        """Aim ``how`` at ``phase``; act as the test must; wait for the recovery.

        Returns the cell: the hit, the ranks before and which of them are
        still alive after, and the ``outcome``: ``"in-process"`` (one more
        world of survivors trains) or ``"restart"`` (the whole job restarted).
        """
        if phase not in REGROUPING:  # the world is whole again: the newcomer joined
            self._grow()
        before = self.ranks()
        if not before:
            raise ChainBroken(f"no rank trains before the fault at {phase}:\n{self.log()[-3000:]}")
        workers = {p: psutil.Process(p).ppid() for p in before}
        trap = {"phase": phase, "action": "pause" if how in PAUSED else how}
        if phase in SURVIVORS:
            aimed = sorted(before)[len(self.cells) % len(before)]
            trap["pid"] = psutil.Process(aimed).ppid() if phase == "word" else aimed
        mark = len(self.log())
        (self.traps / "trap.tmp").write_text(json.dumps(trap))
        os.replace(self.traps / "trap.tmp", self.traps / "trap")
        if phase in REGROUPING:
            self.gate.touch()  # the last fault's newcomer may join: the regrouping starts
        hit = self._wait_for_hit()
        self.gate.unlink(missing_ok=True)
        worker = hit["pid"] if phase == "word" else hit["worker"]
        self.act(how, phase, hit, worker)
        # the faulty process, and at "word" (a worker) the rank it leaves too
        faulty = [hit["pid"], *(p for p, w in workers.items() if w == hit["pid"])]
        others = sorted(p for p in before if p not in faulty)
        cell = {"phase": phase, "how": how, "hit": hit, "before": sorted(before), "others": others}
        self.cells.append(cell)
        lost = self.wait(mark, LOST_ROUND + r" (\d+)", RESTART)
        cell["outcome"] = "in-process" if lost.re.pattern != RESTART else "restart"
        if cell["outcome"] == "restart":  # its round: after every round said so far
            cell["round"] = 1 + max(int(r) for r in re.findall(r"round (\d+)", self.log()))
            return cell
        cell["round"] = int(lost.group(1))
        self.after_lost(how, phase, worker, cell)
        if not self._trains_again(mark, int(lost.group(1))):
            cell["outcome"] = "restart"  # the smaller world failed too
            return cell
        cell["kept"] = [p for p in others if psutil.pid_exists(p)]
        return cell

    def act(self, how: str, phase: str, hit: dict, worker: int) -> None:
        """What the test does once the trap of ``how`` was taken (``hit``)."""
        if how == "lost":
            os.kill(worker, signal.SIGKILL)  # its rank dies with it
            (self.traps / f"release.{hit['pid']}").touch()
        if how == "lost" or (phase == "word" and how == "kill"):  # a worker is gone
            self._new_worker()

    def after_lost(self, how: str, phase: str, worker: int, cell: dict) -> None:
        """What the test does once the scheduler went on without the faulty rank."""
        if phase == "word" and how == "stop":  # the scheduler lost the frozen worker
            os.kill(worker, signal.SIGKILL)
            self._new_worker()

    def _trains_again(self, mark: int, round_: int) -> bool:
        """Until a world of round ``round_`` or later trains: every rank took two steps in it.

        False if the whole job restarted instead.

        (The scheduler's line comes before the first step, and a step is recorded
        before its hook: a first step's trap set before a rank's second step
        would hit this world, not the next one.)
        """
        while True:
            again = self.wait(mark, r"round (\d+): \d+ " + AGAIN, RESTART)
            if again.re.pattern == RESTART:
                return False
            if int(again.group(1)) >= round_:
                break
            mark += again.end()
        deadline = time.monotonic() + self.limit_s
        while not all(self._stepped_in(f, round_) for f in self.ranks().values()):
            if self.job.procs["scheduler"].poll() is not None or time.monotonic() > deadline:
                raise ChainBroken(f"no step in round {round_}:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        return True

    @staticmethod
    def _stepped_in(ids: Path, round_: int) -> bool:
        lines = ids.read_text().splitlines()[-3:]
        return sum('"ids"' in ln and json.loads(ln)["round"] >= round_ for ln in lines) >= 2

    def _grow(self) -> None:
        """Let the waiting newcomer join; until the world of 3 trains again."""
        if not self.cells:  # the job's start: until its three ranks train
            deadline = time.monotonic() + self.limit_s
            while len(self.ranks()) < WORKERS:
                if time.monotonic() > deadline or self.job.procs["scheduler"].poll() is not None:
                    raise ChainBroken(f"the job never trained on {WORKERS}:\n{self.log()}")
                time.sleep(0.1)
            return
        mark = len(self.log())
        self.gate.touch()  # (the scheduler said "joins" when the newcomer registered)
        grown = self.wait(mark, rf"round (\d+): {WORKERS} {AGAIN}")
        if not self._trains_again(mark, int(grown.group(1))):
            raise ChainBroken(f"the job restarted as it grew:\n{self.log()[-4000:]}")
        self.gate.unlink()

    def _wait_for_hit(self) -> dict:
        deadline = time.monotonic() + self.limit_s
        while not (self.traps / "hit").exists():
            self._aim_again()
            if self.job.procs["scheduler"].poll() is not None or time.monotonic() > deadline:
                raise ChainBroken(f"the trap was never taken:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        hit = json.loads((self.traps / "hit").read_text())
        (self.traps / "hit").rename(self.traps / f"hit.{len(self.cells)}")
        return hit

    def _aim_again(self) -> None:
        """A trap aimed at a rank that ended before the phase (a frozen peer's last
        seconds, say) goes to another rank, so that it still fires."""
        try:
            trap = json.loads((self.traps / "trap").read_text())
        except (OSError, ValueError):
            return
        pid = trap.get("pid")
        if pid is None or trap["phase"] == "word" or _alive(pid):
            return
        left = sorted(self.ranks())
        try:  # take it back first (a rename: atomic), unless a process took it meanwhile
            os.rename(self.traps / "trap", self.traps / "trap.again")
        except OSError:
            return
        (self.traps / "trap.tmp").write_text(json.dumps({**trap, "pid": left[0] if left else None}))
        os.replace(self.traps / "trap.tmp", self.traps / "trap")

    def _new_worker(self) -> None:
        self.job.start(f"new{self.new_workers}", [WORKERS_SH, "1", *self.job.train])
        self.new_workers += 1

    def stop_everything(self) -> None:
        """After a failed check: end the job's processes (each tree), so none outlives the test."""
        for proc in self.job.procs.values():
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            except psutil.Error:
                continue
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass

    # ------------------------------------------------------------ the end
    def finish(self, end: str | None = None) -> tuple[dict, str]:
        """Let the last newcomer join and training end; the job's output and a report.

        ``end``: a fault (``kill``, ``stop``, ``lost``) aimed at the job's end on
        one rank, as its training function returns.
        """
        self._grow()
        if end is not None:
            aimed = sorted(self.ranks())[0]
            trap = {"phase": "end", "action": "pause" if end == "lost" else end, "pid": aimed}
            (self.traps / "trap").write_text(json.dumps(trap))
        self.pace.unlink()
        if end is not None:
            hit = self._wait_for_hit()
            self.cells.append({"phase": "end", "how": end, "hit": hit})
            if end == "lost":
                os.kill(hit["worker"], signal.SIGKILL)
                (self.traps / f"release.{hit['pid']}").touch()
        result = self.job.finish()
        report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())
        return result, report


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def check_chain(chain: Chain, result: dict, report: str, root: Path) -> None:
    """One recovery per fault, exact samples, a fault-free replay's weights."""
    sched = result["scheduler"][1]
    assert result["scheduler"][0] == 0, report
    at_end = [c for c in chain.cells if c["phase"] == "end"]
    # never the whole job, but after a fault at its end (once training returned)
    assert len(re.findall(RESTART, sched)) == len(at_end), report
    # (a loss at the end that reached the scheduler before a survivor's "finished" began
    # a regroup, which that "finished" turned into the restart: rounds.lost_at_the_end)
    begun = len(re.findall(RESTART + r"\d+ after rank \d+ had finished training when", sched))
    assert sched.count(LOST_ROUND) == len(chain.cells) - len(at_end) + begun, report
    schedule = replay_schedule(sched)
    finals = replay_worlds(root / "replay", schedule, SAMPLES, EPOCHS)
    job_w, ref_w = final_weights(chain.out), final_weights(finals[-1])
    # every rank of the last world writes its weights (so may the ranks of a job's end)
    assert len(ref_w) == schedule[-1][1] <= len(job_w), (len(job_w), len(ref_w), schedule)
    for w in job_w + ref_w[1:]:
        np.testing.assert_array_equal(w, ref_w[0])
    ids = trained_ids(chain.out)
    assert sorted(ids) == list(range(EPOCHS)), sorted(ids)
    for epoch, counts in ids.items():  # pad mode's repeats weigh 0: each sample once
        assert counts == collections.Counter(range(SAMPLES)), (epoch, schedule, counts)


def replay_schedule(sched: str, workers: int = WORKERS) -> list[tuple[int, int]]:
    """(first step, ranks) of each world the job trained in, from the scheduler's lines
    (a job of ``workers``: benchmarks/goodput.py runs 4).

    A world that trained no step (the next began at its first) is left out,
    and one of the size of the world before continues it: a checkpoint and a
    restart on as many ranks change nothing (tests/test_checkpoint_mp.py), so
    the replay runs them as one.
    """
    changes = {
        int(r): (int(s), int(n))
        for r, n, s in re.findall(r"round (\d+): (\d+) ranks train again from step (\d+)", sched)
    }
    worlds = [(0, workers)] + [changes[r] for r in sorted(changes)]
    # a whole-job restart (only after a fault at the end): all the workers, from the checkpoint
    restarts = re.findall(r"resuming from checkpoint step (\d+)", sched)
    worlds += [(int(start), workers) for start in restarts]
    trained = [w for w, nxt in zip(worlds, [*worlds[1:], (None, 0)], strict=True) if nxt[0] != w[0]]
    schedule = trained[:1]
    for start, size in trained[1:]:
        if size != schedule[-1][1]:
            schedule.append((start, size))
    return schedule


def run_chain(root: Path, cells: list[tuple[str, str]], end: str | None = None) -> None:
    """Aim ``cells`` one after another at one job, then ``end`` at its end; check it all."""
    chain = Chain(root / "job", limit_s=CELL_LIMIT_S)
    try:
        for phase, how in cells:
            cell = chain.fault(phase, how)
            assert cell["outcome"] == "in-process", (cell, chain.log()[-4000:])
            assert cell["kept"] == cell["others"], cell  # they went on in their processes
        result, report = chain.finish(end)
    finally:
        chain.stop_everything()
        (root / "scheduler.log").write_text(chain.log())  # for a failure's reader
    check_chain(chain, result, report, root)


# Every phase once, in an order where each regrouping phase finds the last fault's
# newcomer, the kinds of fault in turn; then every kind at Horovod's start and at the
# rollback, where the newcomer's own start or restore fails too (the other pairs:
# benchmarks/chaos.py, whose table is in docs/elastic.md; one job of all 33 would
# outlast the suite's budget).
CELLS = [
    ("step", "kill"),
    ("word", "stop"),
    ("save", "lost"),
    ("leave", "kill"),
    ("exchange", "stop"),
    ("meet", "lost"),
    ("reshard", "kill"),
    ("first_step", "stop"),
    ("restore", "lost"),
    *((phase, how) for phase in ("init", "rollback") for how in ("kill", "stop", "lost")),
]


def test_a_fault_at_each_phase_costs_one_recovery_and_ends_as_a_fault_free_replay(tmp_path):
    """... Horovod's start and the rollback with each kind of fault; and a rank killed
    at the job's end (its training function returned, so the others may run the
    script's code after training: nothing to roll back into) costs exactly one
    whole-job restart, from the last checkpoint."""
    run_chain(tmp_path, CELLS, end="kill")
