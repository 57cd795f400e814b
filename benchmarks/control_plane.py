"""The scheduler's control plane at N workers: simulated workers, the real scheduler and protocol.

The scheduler (:class:`hvdkit.launch.scheduler.Scheduler`, elastic) runs in its
own process; N simulated workers run as threads of this one, each speaking the
real worker protocol through hvdkit's own code: a TCP connection from its own
loopback address (``127.0.0.<2 + i // per_host>``, so ``--per-host`` workers
share a simulated machine), the challenge and signed registration
(:func:`hvdkit.launch.protocol.register`), keep-alives both ways at the real
interval (:meth:`~hvdkit.launch.protocol.Channel.keep_alive`), ``ready`` for an
in-process world, ``exit`` with status 75 after a ``preempt``. No TensorFlow,
no program: a simulated worker answers at once, so every time below is the
control plane's own. Per N it measures:

* ``register_s``: from the scheduler listening to every worker holding its
  first assignment (all N start at once);
* the scheduler's steady state: CPU (share of one core), RSS and threads over
  ``--steady`` seconds of keep-alives, nothing else happening;
* ``regroup_s``: from one worker's connection closing (its machine lost) to
  every survivor holding the next round's assignment, and ``go_s`` to every
  survivor told ``go`` (each said ``ready`` on receipt);
* ``preempt_s``: from ``SIGTERM`` to the scheduler to every worker holding its
  ``preempt``, and ``done_s`` to every worker told the job's end;
* the messages of each event (keep-alives not counted), sent by the scheduler
  and by the workers.

The machine's load average and steal share (``/proc/stat``) during each N are
recorded: on a shared machine the other work shows in every time.

    python benchmarks/control_plane.py                      # N = 16, 64, 256, 1000
    python benchmarks/control_plane.py --sizes 16,64 --steady 10

Prints a table, writes bench_results/control_plane.json and
docs/control_plane_bench.svg; a run cited in docs/performance-record.md is
kept in benchmarks/records/ (``--record NAME``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
from _common import REPO, job_env, steal_share, write_record, write_results
from _svg import Series, document, legend, line_chart

sys.path.insert(0, str(REPO))
from hvdkit import config
from hvdkit.launch import protocol
from hvdkit.launch.heartbeat import stall_timeout
from hvdkit.launch.transport import cpu_ticks

TOKEN = "control-plane-benchmark-token"
SIZES = (16, 64, 256, 1000)
PREEMPT_STEP = 7  # what a simulated rank says it stopped after


class SimWorker:
    """One simulated worker: a registered channel and a reader thread that answers at once.

    ``got`` holds ``(monotonic time, type, round)`` of every message received
    (keep-alives are skipped by the channel); ``said`` counts what it sent.
    """

    def __init__(self, index: int, source: str, port: int, silence_s: float):
        self.index, self.source, self.port, self.silence_s = index, source, port, silence_s
        self.got: list[tuple[float, str, int]] = []
        self.assigns: list[dict] = []  # every assignment, as received
        self.said: Counter = Counter()
        self.ch: protocol.Channel | None = None
        self.round = -1
        self.registered_at: float | None = None
        self.error = ""
        self.busy_retries = 0
        self._lock = threading.Lock()

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name=f"sim-{self.index}", daemon=True)
        t.start()
        return t

    def _connect(self, deadline: float) -> None:
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((self.source, 0))
            sock.settimeout(30)
            try:
                sock.connect(("127.0.0.1", self.port))
                sock.settimeout(None)
                ch = protocol.Channel(sock)
                protocol.register(
                    ch, TOKEN, time.monotonic() + 30, hostname=self.source, pid=10000 + self.index
                )
            except protocol.Busy:  # as hvdkit.launch.worker.join: try again
                sock.close()
                self.busy_retries += 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            self.ch = ch
            self.registered_at = time.monotonic()
            ch.keep_alive(self.silence_s)
            return

    def _run(self) -> None:
        try:
            self._connect(time.monotonic() + 300)
            while True:
                msg = self.ch.recv()
                if msg is None:
                    return
                self._answer(msg)
        except (OSError, protocol.Refused) as exc:
            if not self.error and not getattr(self, "lost", False):
                self.error = f"{type(exc).__name__}: {exc}"

    def _answer(self, msg: dict) -> None:
        kind, rnd = str(msg.get("type")), msg.get("round", -1)
        with self._lock:
            self.got.append((time.monotonic(), kind, rnd if isinstance(rnd, int) else -1))
        if kind == "assign":
            self.assigns.append(msg)
            self.round = int(msg["round"])
            if msg.get("inplace"):  # its program is ready to meet the new world at once
                self._send(type=protocol.READY, round=self.round)
        elif kind == "preempt":
            detail = f"preempted after step {PREEMPT_STEP}"
            self._send(type="exit", round=self.round, code=config.EXIT_PREEMPTED, detail=detail)

    def _send(self, **msg) -> None:
        self.said[msg["type"]] += 1
        self.ch.send(**msg)

    def lose(self) -> None:
        """The worker's machine is gone: its connection closes without a word."""
        self.lost = True
        self.ch.close()

    def first(self, kind: str, round_: int | None = None, since: float = 0.0) -> float | None:
        with self._lock:
            for t, k, r in self.got:
                if k == kind and t >= since and (round_ is None or r == round_):
                    return t
        return None

    def counts(self, since: float, until: float) -> Counter:
        with self._lock:
            return Counter(k for t, k, _ in self.got if since <= t < until)


# ---------------------------------------------------------------- the scheduler's process
class ThreadPerChannel:
    """The scheduler's reading as it was before 2026-11-29: a thread per channel (``--compare``).

    Same callbacks as :class:`hvdkit.launch.listening.Listener`; each thread
    blocks in :meth:`~hvdkit.launch.protocol.Channel.recv`, which raises
    :class:`~hvdkit.launch.protocol.Silent` after the silence limit.
    """

    def __init__(self, heard, ended):
        self.heard, self.ended = heard, ended

    def add(self, channel, who) -> None:
        def loop():
            while True:
                try:
                    msg = channel.recv()
                except protocol.Silent as exc:
                    return self.ended(who, exc)
                except Exception:
                    msg = None
                if msg is None:
                    return self.ended(who, None)
                self.heard(who, msg)

        threading.Thread(target=loop, daemon=True).start()

    def close(self) -> None:
        pass


def scheduler_main(n: int, port: int) -> int:
    """The child: an elastic scheduler for ``n`` workers; says READY on stdout once listening."""
    import logging

    from hvdkit.launch import scheduler
    from hvdkit.launch.scheduler import Scheduler

    if os.environ.get("CONTROL_PLANE_THREAD_PER_CHANNEL"):
        scheduler.Listener = ThreadPerChannel

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sched = Scheduler(
        "127.0.0.1", port, n, TOKEN, 600.0, max_restarts=1, min_workers=max(1, n // 2), elastic=True
    )
    print("READY", flush=True)
    return sched.run()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(workers, kind: str, round_: int | None, since: float, timeout: float) -> float | None:
    """Seconds from ``since`` until every worker in ``workers`` got ``kind``; None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        times = [w.first(kind, round_, since) for w in workers]
        if all(t is not None for t in times):
            return max(times) - since
        time.sleep(0.01)
    return None


def messages(workers, since: float, until: float) -> dict:
    got = Counter()
    for w in workers:
        got.update(w.counts(since, until))
    return dict(got)


def said_total(workers) -> Counter:
    out = Counter()
    for w in workers:
        out.update(w.said)
    return out


def measure(n: int, per_host: int, steady_s: float, log_dir: Path, old: bool = False) -> dict:
    port = free_port()
    log = open(log_dir / f"scheduler_{n}.log", "w")
    env = job_env(REPO, REPO / "benchmarks")
    if old:
        env["CONTROL_PLANE_THREAD_PER_CHANNEL"] = "1"
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--scheduler", str(n), str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    proc = psutil.Process(child.pid)
    result: dict = {"n": n, "per_host": per_host, "hosts": -(-n // per_host)}
    result["reading"] = "thread per channel" if old else "one thread"
    ticks0, load0 = cpu_ticks(), os.getloadavg()
    try:
        if child.stdout.readline().strip() != "READY":
            raise RuntimeError(f"the scheduler did not start; see {log.name}")
        silence = protocol.silence_limit(stall_timeout())
        workers = [SimWorker(i, f"127.0.0.{2 + i // per_host}", port, silence) for i in range(n)]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        result["register_s"] = wait_all(workers, "assign", 0, t0, 300)
        result["registered_s"] = max(w.registered_at or float("nan") for w in workers) - t0
        result["busy_retries"] = sum(w.busy_retries for w in workers)
        if result["register_s"] is None:
            errors = Counter(w.error for w in workers if w.error)
            raise RuntimeError(f"not every worker was assigned: {errors.most_common(3)}")
        result["register_msgs"] = messages(workers, t0, time.monotonic())

        # steady state: keep-alives only
        time.sleep(3.0)
        cpu0, w0, s0 = proc.cpu_times(), time.monotonic(), cpu_ticks()
        time.sleep(steady_s)
        cpu1, w1 = proc.cpu_times(), time.monotonic()
        busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        result["steady_cpu_share"] = round(busy / (w1 - w0), 4)
        result["steady_rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
        result["scheduler_threads"] = proc.num_threads()
        result["steady_steal"] = steal_share(s0, cpu_ticks())
        result["steady_msgs"] = messages(workers, w0, w1)

        # one lost worker: the survivors regroup in-process
        victim = workers[n // 2]
        survivors = [w for w in workers if w is not victim]
        said0 = said_total(survivors)
        cpu0 = proc.cpu_times()
        t0 = time.monotonic()
        victim.lose()
        result["regroup_s"] = wait_all(survivors, "assign", 1, t0, 120)
        result["go_s"] = wait_all(survivors, "go", 1, t0, 120)
        cpu1 = proc.cpu_times()
        result["regroup_cpu_s"] = round((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), 3)
        time.sleep(0.5)
        result["regroup_msgs"] = messages(survivors, t0, time.monotonic())
        result["regroup_said"] = dict(said_total(survivors) - said0)

        # preemption: SIGTERM to the scheduler
        said0 = said_total(survivors)
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        result["preempt_s"] = wait_all(survivors, "preempt", None, t0, 120)
        result["done_s"] = wait_all(survivors, "done", None, t0, 120)
        result["exit_code"] = child.wait(timeout=60)
        result["preempt_msgs"] = messages(survivors, t0, time.monotonic())
        result["preempt_said"] = dict(said_total(survivors) - said0)
        result["worker_errors"] = sorted({w.error for w in survivors if w.error})[:3]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        log.close()
    result["load_avg_start"], result["load_avg_end"] = load0, os.getloadavg()
    result["steal"] = steal_share(ticks0, cpu_ticks())
    for w in workers:
        if w.ch is not None:
            w.ch.close()
    return result


# ---------------------------------------------------------------- report
def fmt(v, scale=1.0, digits=2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _messages(r: dict) -> tuple[int, int]:
    """Messages both ways per regroup and per preemption, in a row."""
    regroup = sum(r["regroup_msgs"].values()) + sum(r["regroup_said"].values())
    return regroup, sum(r["preempt_msgs"].values()) + sum(r["preempt_said"].values())


def table(rows: list[dict]) -> str:
    head = (
        f"{'N':>5} {'hosts':>5} {'register s':>10} {'CPU %':>6} {'RSS MiB':>8} {'threads':>7} "
        f"{'regroup s':>9} {'go s':>6} {'preempt s':>9} {'done s':>6} "
        f"{'msgs/regroup':>12} {'msgs/preempt':>12}"
    )
    lines = [head]
    for r in rows:
        regroup, preempt = _messages(r)
        lines.append(
            f"{r['n']:>5} {r['hosts']:>5} {fmt(r['register_s']):>10} "
            f"{fmt(r['steady_cpu_share'], 100, 1):>6} {r['steady_rss_mib']:>8} "
            f"{r['scheduler_threads']:>7} {fmt(r['regroup_s'], 1, 3):>9} "
            f"{fmt(r['go_s'], 1, 3):>6} {fmt(r['preempt_s'], 1, 3):>9} "
            f"{fmt(r['done_s'], 1, 3):>6} {regroup:>12} {preempt:>12}"
        )
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """docs/performance.md's control plane table of ``rows`` (a run's ``rows``)."""
    lines = [
        "| workers (machines) | all registered and assigned, s | scheduler CPU, % of a core "
        "| RSS, MiB | threads | a loss to every survivor assigned, s | ... told `go`, s "
        "| `SIGTERM` to every worker told `preempt`, s | ... told the end, s "
        "| messages per regroup / preemption |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        regroup, preempt = _messages(r)
        lines.append(
            f"| {r['n']:,} ({r['hosts']}) | {r['register_s']:.2f} "
            f"| {100 * r['steady_cpu_share']:.1f} | {r['steady_rss_mib']:.0f} "
            f"| {r['scheduler_threads']} | {r['regroup_s']:.2f} | {r['go_s']:.2f} "
            f"| {r['preempt_s']:.3f} | {r['done_s']:.2f} | {regroup:,} / {preempt:,} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, note: str) -> None:
    labels = [str(r["n"]) for r in rows]
    xs = [float(r["n"]) for r in rows]
    times = [
        Series("all registered and assigned", "#1f77b4", [r["register_s"] for r in rows]),
        Series("regroup: every survivor assigned", "#d62728", [r["regroup_s"] for r in rows]),
        Series("regroup: every survivor told go", "#ff7f0e", [r["go_s"] for r in rows], True),
        Series("SIGTERM: every worker told preempt", "#2ca02c", [r["preempt_s"] for r in rows]),
    ]
    shares = [r["steady_cpu_share"] * 100 for r in rows]
    cpu = [Series("scheduler CPU, % of a core", "#9467bd", shares)]
    parts = line_chart(
        0,
        0,
        440,
        300,
        title="Seconds to reach every worker",
        x_labels=labels,
        y_label="s",
        series=times,
        x_values=xs,
    )
    parts += line_chart(
        450,
        0,
        440,
        300,
        title="Scheduler in steady state (keep-alives)",
        x_labels=labels,
        y_label="% of a core",
        series=cpu,
        x_values=xs,
        log_y=False,
    )
    parts += legend(10, 310, times + cpu, columns=2, col_width=440)
    Path(path).write_text(document(900, 380, parts, footnote=note))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scheduler", nargs=2, type=int, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--per-host", type=int, default=8, help="simulated workers per machine")
    p.add_argument("--steady", type=float, default=20.0, help="seconds of steady state measured")
    p.add_argument("--plot", default=str(REPO / "docs" / "control_plane_bench.svg"))
    p.add_argument("--record", help="also keep the JSON as benchmarks/records/NAME.json")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also measure each N with the scheduler reading each channel on a thread of its own",
    )
    args = p.parse_args()
    if args.scheduler:
        return scheduler_main(*args.scheduler)
    sizes = [int(s) for s in args.sizes.split(",")]
    log_dir = REPO / "bench_results" / "control_plane_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    before = []
    for n in sizes:
        if args.compare:
            before.append(measure(n, args.per_host, args.steady, log_dir, old=True))
            print("a reading thread per channel:", table(before).splitlines()[-1], flush=True)
        rows.append(measure(n, args.per_host, args.steady, log_dir))
        print(table(rows).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    print()
    print(markdown_table(rows))
    if before:
        print("\nthe scheduler reading each channel on a thread of its own:")
        print(table(before))
    payload = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "cores": os.cpu_count(),
        "keepalive_every_s": protocol.ALIVE_EVERY_S,
        "silence_s": protocol.silence_limit(stall_timeout()),
        "rows": rows,
        "thread_per_channel_rows": before,
    }
    out = write_results("control_plane", payload)
    print(f"wrote {out}")
    if args.record:
        print(f"wrote {write_record(args.record, payload)}")
    if args.plot:
        note = f"{payload['date_utc']} UTC, {payload['commit']}, {os.cpu_count()} cores (shared)"
        plot(rows, Path(args.plot), note)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
