"""The model of recovery at scale: goodput at N ranks from costs measured at N and at 4.

    python benchmarks/scale_model.py            # the table docs/performance.md prints

No measurement of its own: it reads three records of ``benchmarks/records``
and combines them.

* the goodput run (``benchmarks/goodput.py``, 4 workers): what a failure that
  is found at once (a ``SIGKILL`` of a rank, a lost worker) cost the
  survivors there, p50 over those faults of both fault rates: the recovery
  ``r`` (the fault to the smaller world's first step), the join pause ``j``
  (the survivors' last step before the newcomer joined to the first step of
  the whole world), the lost work ``w`` and the newcomer's start ``t`` (its
  program's start to the whole world's first step);
* the control plane (``benchmarks/control_plane.py``): ``C(N)``, a loss to
  every survivor told ``go``, with N simulated workers;
* the rendezvous (``benchmarks/rendezvous.py``): ``G(N)``, a world of N ranks
  formed through hvdkit's mesh.

Each change of world at N ranks costs what it cost at 4 plus what the control
plane and the rendezvous add from their smallest measured size to N, and a
failure costs two of them (the loss, then the newcomer's join), the lost work,
and the share 1/N of the ranks missing while the smaller world trains::

    R(N) = r + C(N) - C(16) + G(N) - G(3)        (the loss)
    J(N) = j + C(N) - C(16) + G(N) - G(3)        (the join)
    L(N) = w + R(N) + J(N) + max(0, t - r - j) / N
    goodput(N, rate) = 1 - rate * L(N)

Example:
    >>> m = Model.from_records()
    >>> round(m.goodput(4, 1 / 60), 3)      # the measured run's setting
    0.944
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from goodput_records import TORCHFT

RECORDS = Path(__file__).resolve().parent / "records"
GOODPUT = RECORDS / "goodput_deferred_join_2026-11-29.json"
CONTROL_PLANE = RECORDS / "control_plane_listener.json"
RENDEZVOUS = RECORDS / "rendezvous_server_2026-11-29.json"
FOUND_AT_ONCE = ("kill", "worker")  # a frozen rank adds the stall timeout, a setting
ROWS = (4, 64, 300, 1000)  # the sizes the docs' table predicts


def _p50(values: list[float]) -> float:
    return statistics.median(values)


def _interpolate(points: dict[int, float], n: int) -> float:
    """``points`` at ``n``: measured, or on the line between the two measured sizes around it."""
    if n in points:
        return points[n]
    below = max(k for k in points if k < n)
    above = min(k for k in points if k > n)
    share = (n - below) / (above - below)
    return points[below] + share * (points[above] - points[below])


@dataclass(frozen=True)
class Model:
    """The measured inputs (seconds) and the model's arithmetic over them."""

    r: float  # recovery of a failure found at once, at 4 workers (p50)
    j: float  # join pause at 4 workers (p50)
    w: float  # lost work at 4 workers (p50)
    t: float  # newcomer's start to the whole world training, at 4 workers (p50)
    control: dict[int, float]  # C(N): a loss to every survivor told go
    rendezvous: dict[int, float]  # G(N): a world formed through hvdkit's mesh

    @classmethod
    def from_records(
        cls, goodput: Path = GOODPUT, control: Path = CONTROL_PLANE, rendezvous: Path = RENDEZVOUS
    ) -> Model:
        """The model of the recorded runs (the ones docs/performance.md prints)."""
        runs = json.loads(goodput.read_text())["runs"]
        faults = [f for run in runs[1:] for f in run["faults"] if f["kind"] in FOUND_AT_ONCE]
        plane = json.loads(control.read_text())["rows"]
        meshes = [
            row
            for run in json.loads(rendezvous.read_text())["runs"]
            if run["label"] == "after"
            for row in run["rows"]
        ]
        worlds: dict[int, list[float]] = {}
        for row in meshes:
            worlds.setdefault(row["n"], []).append(row["world_s"])
        return cls(
            r=_p50([f["recovery_s"] for f in faults]),
            j=_p50([f["join_pause_s"] for f in faults]),
            w=_p50([f["lost_work_s"] for f in faults]),
            t=_p50([f["newcomer_s"] for f in faults]),
            control={row["n"]: row["go_s"] for row in plane},
            # the sizes run once, and 1,000 ranks as the median of its runs
            rendezvous={n: _p50(v) for n, v in worlds.items()},
        )

    def c(self, n: int) -> float:
        """C(n), s (sizes between two measured ones: on the line between them)."""
        return _interpolate(self.control, max(n, min(self.control)))

    def g(self, n: int) -> float:
        """G(n), s (4 ranks: as measured at 3)."""
        return _interpolate(self.rendezvous, 3 if n == 4 else n)

    def added(self, n: int) -> float:
        """What the control plane and the rendezvous add to a change of world from 4 to n."""
        return (self.c(n) - self.c(4)) + (self.g(n) - self.g(4))

    def per_failure(self, n: int, as_at_4: bool = False) -> float:
        """L(n): seconds of training at n ranks a failure found at once costs."""
        added = 0.0 if as_at_4 else self.added(n)
        fewer = max(0.0, self.t - self.r - self.j) / n
        return self.w + (self.r + added) + (self.j + added) + fewer

    def goodput(self, n: int, rate: float, as_at_4: bool = False) -> float:
        """Committed samples per second at ``rate`` failures a second, over fault-free; >= 0."""
        return max(0.0, 1.0 - rate * self.per_failure(n, as_at_4))


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def markdown_table(model: Model) -> str:
    """docs/performance.md's model table."""
    lines = [
        "| ranks | C(N), s | G(N), s | a change of world: loss R(N) / join J(N), s "
        "| a failure costs L(N), s | goodput, 1 failure per 60 s | per 15 s "
        "| both, if a world formed as fast as at 4 ranks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in ROWS:
        label = {4: "4 (the goodput run; C at 16, G at 3)", 300: "300 (C between 256 and 1,000)"}
        added = model.added(n)
        at_4 = f"{_pct(model.goodput(n, 1 / 60, True))}, {_pct(model.goodput(n, 1 / 15, True))}"
        lines.append(
            f"| {label.get(n, f'{n:,}')} | {model.c(n):.2f} | {model.g(n):.2f} "
            f"| {model.r + added:.2f} / {model.j + added:.2f} | {model.per_failure(n):.2f} "
            f"| {_pct(model.goodput(n, 1 / 60))} | {_pct(model.goodput(n, 1 / 15))} | {at_4} |"
        )
    lines.append(
        "| TorchFT, 300 GPUs in 30 replica groups (published) | | | | "
        f"| {TORCHFT[60]:.1f} % | {TORCHFT[15]:.1f} % | |"
    )
    return "\n".join(lines)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    model = Model.from_records()
    print(
        f"at 4 workers, p50 over the faults found at once: recovery {model.r:.2f} s, join pause "
        f"{model.j:.2f} s, lost work {model.w:.2f} s, newcomer's start {model.t:.2f} s\n"
    )
    print(markdown_table(model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
