"""In-process recovery and growth (hvdkit.elastic) under the scheduler/worker launch, Gloo.

The job (tests/multiproc/ft_train.py ``--mode elastic``: ``model.fit`` inside
``@hvdkit.elastic.run`` with a Checkpointer saving every 5 steps) trains 3
epochs of 96 samples, 4 per rank and step, on 3 workers (``HVDKIT_MIN_WORKERS=2``,
``HVDKIT_ELASTIC=1``). Rank 2 kills its worker inside step 12: the two other
ranks must go on in their own processes (no restart), rolled back to step 10,
as ranks of a world of 2. They stop inside step 14 until a new worker, started
once the scheduler said so, is ready to join; then they admit it at their next
commit boundary (step S, nothing trained twice) and the three finish the job.

The reference is the same schedule of world sizes without in-process
recovery: a whole-job restart on the two workers left from the step-10
checkpoint on disk, stopped after step S with a checkpoint, then three
workers from that checkpoint. Both must end with the same weights, bit for
bit, and have trained every sample of every epoch exactly once (the steps
after the last save, redone, counted once).

No test bounds wall-clock time: the waits' deadlines only turn a hang into a
failure, and the newcomer's arrival is ordered by the hold, not by speed.
"""

from __future__ import annotations

import collections
import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from test_launch_mp import PY, SCHEDULER_SH, WORKERS_SH, free_port, sched_env

from conftest import MULTIPROC, launcher_env

FT_TRAIN = str(MULTIPROC / "ft_train.py")
HANG = 900  # seconds: only a hang gets near this
SAMPLES, EPOCHS, CRASH, EVERY, HOLD = 96, 3, 12, 5, 14
LAST_SAVE = CRASH // EVERY * EVERY  # 10: what both ways go back to


class Job:
    """Processes started together, their output collected line by line as they run."""

    def __init__(self, root: Path, env: dict, where=None):
        self.root, self.env = root, env
        # where(name): the command prefix that runs process ``name`` where it belongs
        # (e.g. ``ip netns exec HOST``: benchmarks/chaos.py --cut); nothing by default
        self.where = where or (lambda name: [])
        self.procs: dict[str, subprocess.Popen] = {}
        self.readers: list[threading.Thread] = []
        self.lines: dict[str, list[str]] = {}
        self.times: dict[str, list[float]] = {}  # when each line came (time.time())
        self._new_line = threading.Condition()

    def start(self, name: str, cmd: list[str]) -> None:
        proc = subprocess.Popen(
            [*self.where(name), *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=self.root,
        )
        self.procs[name], self.lines[name], self.times[name] = proc, [], []
        reader = threading.Thread(target=self._read, args=(name, proc), daemon=True)
        reader.start()
        self.readers.append(reader)

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._new_line:
                self.lines[name].append(line)
                self.times[name].append(time.time())
                self._new_line.notify_all()

    def wait_for(self, name: str, text: str) -> str:
        """The first line of ``name`` holding ``text``; fails if its process ends first."""
        deadline = time.monotonic() + HANG
        with self._new_line:
            while True:
                found = [ln for ln in self.lines[name] if text in ln]
                if found:
                    return found[0]
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{name} never said {text!r}:\n{self._everyone()}")
                self._new_line.wait(timeout=1.0)

    def wait_for_count(self, name: str, text: str, count: int) -> None:
        """Until ``count`` lines of ``name`` hold ``text``; fails if its process ends first."""
        deadline = time.monotonic() + HANG
        with self._new_line:
            while sum(text in ln for ln in self.lines[name]) < count:
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"{name} said {text!r} fewer than {count} times:\n{self._everyone()}"
                    )
                self._new_line.wait(timeout=1.0)

    def _everyone(self) -> str:
        """Every process's last output (the lock is held)."""
        return "\n".join(f"--- {n}\n{''.join(ln)[-3000:]}" for n, ln in self.lines.items())

    def output(self, name: str) -> str:
        with self._new_line:
            return "".join(self.lines[name])

    def finish(self) -> dict[str, tuple[int, str]]:
        codes = {n: p.wait(timeout=HANG) for n, p in self.procs.items()}
        for reader in self.readers:  # each ends with its pipe
            reader.join(timeout=HANG)
        return {n: (codes[n], self.output(n)) for n in self.procs}


def start_job(
    root: Path,
    *extra: str,
    workers: int = 3,
    samples: int = SAMPLES,
    epochs: int = EPOCHS,
    where=None,
    **settings: str,
) -> tuple[Job, Path]:
    """Scheduler + ``workers`` workers running ft_train --mode elastic; the job and its folder.

    ``HVDKIT_WORKER_NUM`` is ``workers`` and ``HVDKIT_MIN_WORKERS`` 2 unless
    ``settings`` say otherwise; ``where``: as for :class:`Job`."""
    out = root / "out"
    out.mkdir(parents=True)
    env = {
        **launcher_env(),
        **sched_env(
            free_port(),
            worker_num=workers,
            **{"HVDKIT_MIN_WORKERS": "2", "HVDKIT_CHECKPOINT_DIR": str(out / "ckpt"), **settings},
        ),
    }
    job = Job(root, env, where)
    job.train = [PY, FT_TRAIN, str(out), "--mode", "elastic", "--epochs", str(epochs)]
    job.train += ["--samples", str(samples), "--every", str(EVERY), *extra]
    job.start("scheduler", [SCHEDULER_SH])
    for i in range(workers):
        job.start(f"worker{i}", [WORKERS_SH, "1", *job.train])
    return job, out


def survivor(job: Job, rank: int) -> int:
    """Which of the job's first workers started the program of ``rank``."""
    for i in range(3):
        if job.lines[f"worker{i}"] and f"rank {rank} of 3 " in job.lines[f"worker{i}"][0]:
            return i
    raise AssertionError(f"no worker started rank {rank}")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_ids(out: Path, upto: int | None = None) -> dict[int, collections.Counter]:
    """Per epoch, the ids whose steps live on in the final weights; with ``upto``, only
    those of steps up to that one.

    Each round of the job (a restart, an in-process recovery, a growth) began at a
    step: a process's first line says it for the round it started in, a recovery
    mark for the round it went on in. A step trained in round r counts if it is not
    after the step the next round began at (later ones were rolled back, and
    trained again there).
    """
    files = sorted(out.glob("ids-a*-r*.jsonl"))
    began: dict[int, int] = {}
    for f in files:
        rows = records(f)
        if not rows:  # a process killed before its first line (in restore()) trained nothing
            continue
        began.setdefault(int(f.name.split("-")[1][1:]), rows[0]["resumed_from"])
        for rec in rows:
            if "recovered_from" in rec:
                began[rec["round"]] = rec["recovered_from"]
    rounds = sorted(began)
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for f in files:
        for rec in records(f)[1:]:
            if "ids" not in rec or (upto is not None and rec["step"] > upto):
                continue
            later = [r for r in rounds if r > rec["round"]]
            if not later or rec["step"] <= began[later[0]]:
                per_epoch[rec["epoch"]].update(rec["ids"])
    return dict(per_epoch)


def final_weights(out: Path) -> list[np.ndarray]:
    return [np.asarray(json.loads(p.read_text())["weights"]) for p in sorted(out.glob("result-*"))]


def replay_worlds(
    root: Path, schedule: list[tuple[int, int]], samples: int, epochs: int
) -> list[Path]:
    """The worlds of ``schedule`` ((first step, ranks) each) without faults; their folders.

    One job per world, each from the checkpoint the one before stopped at
    (``--stop-at`` the next world's first step), with ``--mask-padding``; a
    world that trained no step before the next formed is skipped.
    """
    ckpt = root / "ckpt"
    ends = [*schedule[1:], (None, 0)]
    finals = []
    for i, ((start, size), (stop, _)) in enumerate(zip(schedule, ends, strict=True)):
        if stop == start:
            continue
        extra = ["--ckpt", str(ckpt), "--mask-padding"]
        extra += [] if stop is None else ["--stop-at", str(stop)]
        ref, out = start_job(
            root / f"world{i}",
            *extra,
            workers=size,
            samples=samples,
            epochs=epochs,
            HVDKIT_MIN_WORKERS=str(size),
        )
        done = ref.finish()
        assert done["scheduler"][0] == 0, (i, schedule, done["scheduler"][1][-3000:])
        assert records(out / "ids-a0-r0.jsonl")[0] == {"resumed_from": start, "size": size}
        finals.append(out)
    return finals


def ended_0_but_the_lost_worker(job: Job) -> tuple[dict[str, tuple[int, str]], str]:
    """Wait for the job; check that it and every worker but rank 2's (lost) ended 0."""
    result = job.finish()
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())
    assert result["scheduler"][0] == 0, report
    codes = {n: c for n, (c, _) in result.items() if n != "scheduler"}
    lost = [n for n in codes if n.startswith("worker") and "rank 2 of 3 " in job.lines[n][0]]
    assert [n for n, c in codes.items() if c != 0] == lost, report
    return result, report


def test_survivors_go_on_in_process_a_new_worker_joins_and_the_job_ends_as_one_cut_in_parts(
    tmp_path,
):
    release = tmp_path / "release"
    crash = ["--crash-at", str(CRASH), "--crash-rank", "2", "--crash-how", "worker"]
    # Steps of at least 0.3 s: the ranks decide whether to admit a newcomer every few.
    hold = ["--hold", str(HOLD), "--hold-until", str(release), "--step-sleep", "0.3"]
    job, e_out = start_job(
        tmp_path / "elastic", *crash, *hold, HVDKIT_ELASTIC="1", HVDKIT_MAX_RESTARTS="2"
    )
    job.wait_for("scheduler", "go on in-process")
    job.start("newcomer", [WORKERS_SH, "1", *job.train])
    job.wait_for("newcomer", "is ready for round 2")
    for rank in (0, 1):  # the survivors' workers left them the new world
        job.wait_for(
            f"worker{survivor(job, rank)}", f"goes on in-process as rank {rank} of 3 (round 2)"
        )
    release.touch()  # the survivors, held in step HOLD, go on to a commit boundary
    # The job ends by itself; the two survivors' processes and the newcomer finished it.
    elastic, report = ended_0_but_the_lost_worker(job)
    sched = elastic["scheduler"][1]
    said = [ln for ln in sched.splitlines() if "workers go on in-process as" in ln]
    assert len(said) == 1 and "2 of 3 workers go on in-process as round 1" in said[0], report
    joins = [ln for ln in sched.splitlines() if " joins: " in ln]
    assert len(joins) == 1 and "3 of 3 workers as round 2 (2 go on in-process" in joins[0], report
    # each round says its kind; neither the in-process round nor the growing one is a restart
    kinds = [ln[ln.rindex("(") :] for ln in sched.splitlines() if "; rendezvous on port" in ln]
    assert kinds == [
        f"({kind} round {n}); 2 of 2 whole-job restarts left"
        for n, kind in enumerate(["first", "in-process", "growing"])
    ], report
    results = sorted(p.name for p in e_out.glob("result-*"))
    assert results == ["result-a0-r0.json", "result-a0-r1.json", "result-a2-r2.json"], results
    assert not list(e_out.glob("ids-a1-*"))  # nobody was started again

    # Shrink: back to the last save; growth: on from a step after the hold, nothing redone.
    marks = {
        rank: [r for r in records(e_out / f"ids-a0-r{rank}.jsonl") if "recovered_from" in r]
        for rank in (0, 1)
    }
    grown_at = marks[0][1]["recovered_from"] if len(marks[0]) == 2 else None
    for rank in (0, 1):
        got = [(m["recovered_from"], m["size"], m["rank"]) for m in marks[rank]]
        assert got == [(LAST_SAVE, 2, rank), (grown_at, 3, rank)], (rank, got)
    assert grown_at is not None and LAST_SAVE < grown_at, marks
    assert records(e_out / "ids-a2-r2.jsonl")[0] == {"resumed_from": grown_at, "size": 3}
    lines = [ln for _, (_, o) in elastic.items() for ln in o.splitlines() if "to rejoin" in ln]
    assert len([ln for ln in lines if f"rolled back to step {LAST_SAVE}; " in ln]) == 2, lines
    assert len([ln for ln in lines if f"went on from step {grown_at}; " in ln]) == 2, lines
    # the scheduler's membership lines name the step each new world trains again from
    again = [ln.split("] ", 1)[-1] for ln in sched.splitlines() if "train again from step" in ln]
    assert [ln[ln.index("round") :] for ln in again] == [
        f"round 1: 2 ranks train again from step {LAST_SAVE}",
        f"round 2: 3 ranks train again from step {grown_at}",
    ], report

    # The same schedule of world sizes without in-process recovery: a whole-job restart on
    # the two workers left, from the step-10 checkpoint, stopped after step grown_at ...
    ref, r_out = start_job(
        tmp_path / "ref",
        *crash,
        "--stop-at",
        str(grown_at),
        "--stop-attempt",
        "1",
        HVDKIT_MAX_RESTARTS="1",
        HVDKIT_REPLACE_TIMEOUT="2",
    )
    first = ref.finish()
    assert first["scheduler"][0] == 0, first["scheduler"][1][-3000:]
    assert "(restart round 1); 0 of 1 whole-job restarts left" in first["scheduler"][1]
    assert records(r_out / "ids-a1-r0.jsonl")[0] == {"resumed_from": LAST_SAVE, "size": 2}
    assert not list(r_out.glob("result-*"))  # it stopped after that step
    # ... and three workers again from that step's checkpoint.
    again, a_out = start_job(tmp_path / "ref-again", "--ckpt", str(r_out / "ckpt"))
    second = again.finish()
    assert second["scheduler"][0] == 0, second["scheduler"][1][-3000:]
    assert records(a_out / "ids-a0-r2.jsonl")[0] == {"resumed_from": grown_at, "size": 3}

    # Both end alike, bit for bit, every sample of every epoch trained once.
    weights = final_weights(e_out) + final_weights(a_out)
    assert len(weights) == 6
    for w in weights[1:]:
        np.testing.assert_array_equal(w, weights[0])
    ref_ids = {e: trained_ids(r_out).get(e, collections.Counter()) for e in range(EPOCHS)}
    for epoch, counts in trained_ids(a_out).items():
        ref_ids[epoch] = ref_ids[epoch] + counts
    ids = trained_ids(e_out)
    assert sorted(ids) == sorted(ref_ids) == list(range(EPOCHS))
    # Every sample once, except pad mode's documented repeats where the world grew from 2
    # to 3 mid-epoch: ceil(R/3)*3 - R of the R samples left are read twice. (The shrink
    # from 3 to 2 at step 10 left 72, no repeat.)
    before = trained_ids(e_out, upto=grown_at)
    for epoch, counts in ids.items():
        cursor = sum(before.get(epoch, {}).values())
        left = SAMPLES - cursor
        repeats = -(-left // 3) * 3 - left if 0 < cursor < SAMPLES else 0
        assert set(counts) == set(range(SAMPLES)), (epoch, counts)
        assert sum(counts.values()) == SAMPLES + repeats, (epoch, cursor, counts)
        assert counts == ref_ids[epoch], (epoch, counts, ref_ids[epoch])


def test_a_worker_ready_to_join_only_after_training_ended_is_sent_away_and_the_job_ends_0(
    tmp_path,
):
    """The end-of-job race: a newcomer that would meet the survivors only once their
    training function has returned (they run the script's code after training: here
    they linger until the test says so). It must be sent away, not waited for: the
    job ends 0, its worker too, and nobody waits out a timeout."""
    release, never, linger = tmp_path / "release", tmp_path / "never", tmp_path / "linger"
    crash = ["--crash-at", str(CRASH), "--crash-rank", "2", "--crash-how", "worker"]
    order = ["--hold", str(HOLD), "--hold-until", str(release), "--join-until", str(never)]
    job, out = start_job(
        tmp_path / "job", *crash, *order, "--linger-until", str(linger), HVDKIT_ELASTIC="1"
    )
    job.wait_for("scheduler", "go on in-process")
    job.start("newcomer", [WORKERS_SH, "1", *job.train])
    job.wait_for("scheduler", "(growing round 2)")  # its program waits for `never`
    release.touch()  # the survivors train to the end of the job
    job.wait_for("scheduler", "sent away (the job finished training)")
    for rank in (0, 1):
        job.wait_for(f"worker{survivor(job, rank)}", "finished training (round 1)")
    linger.touch()
    result, report = ended_0_but_the_lost_worker(job)
    sched, newcomer = result["scheduler"][1], result["newcomer"][1]
    assert sched.count("finished training: the job takes no newcomer now") == 1, report
    # offered a place in round 2, which never formed: round 1's world trained to the end
    assert sched.count(" joins: 3 of 3 workers as round 2") == 1, report
    assert "round 1: 2 ranks train again from step" in sched and "round 2:" not in sched, report
    assert "could not join the job: the job finished training" in newcomer, report
    assert "is ready for round" not in newcomer, report
    results = sorted(p.name for p in out.glob("result-*"))
    assert results == ["result-a0-r0.json", "result-a0-r1.json"], results
    weights = final_weights(out)
    np.testing.assert_array_equal(weights[0], weights[1])
    steps = {json.loads(p.read_text())["final_step"] for p in out.glob("result-*")}
    # 10 steps of 12 samples, then 2 ranks of 4 over the rest of 3 epochs of 96
    assert steps == {LAST_SAVE + (EPOCHS * SAMPLES - 12 * LAST_SAVE) // 8}, steps
    for epoch, counts in trained_ids(out).items():
        assert set(counts) == set(range(SAMPLES)), (epoch, counts)
