"""The state's broadcast of a restore or a roll back: one collective per variable, or packed.

    python benchmarks/state_broadcast.py [--np 2 4] [--repeats 5]
    python benchmarks/state_broadcast.py --from bench_results/state_broadcast.json

:meth:`hvdkit.Checkpointer.restore` and the elastic roll back send rank 0's
header and variables to every rank. Measured side by side in one job per
world size (``hvdkitrun -np N --gloo``), on variables like three models'
(float32, with SGD's momentum slots and an int64 step counter):

* *per variable*: ``broadcast_object`` of the header, then
  ``broadcast_variables`` (one eager broadcast per variable: what hvdkit did
  before :mod:`hvdkit.fault._state_broadcast`);
* *packed*: :func:`~hvdkit.fault._state_broadcast.header` (the header and
  every rank's dtypes and shapes in one ``allgather_object``) and
  :func:`~hvdkit.fault._state_broadcast.variables` (one broadcast per dtype
  and 64 MiB).

The fewest seconds of ``--repeats`` (every rank starting and ending
together), the two interleaved. Prints a table, writes
bench_results/state_broadcast.json. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, job_env, write_results

# name -> float32 variable sizes (elements); each trainable one gets a momentum slot
MODELS = {
    "the goodput job's (4 variables, 1 K parameters)": [16 * 32, 32, 32 * 8, 8],
    "200 variables, 1 M parameters": [5000] * 200,
    "ResNet-50-sized (320 variables, 25.6 M parameters)": [80_000] * 320,
}


def worker(out: Path, repeats: int) -> None:
    import numpy as np
    import tensorflow as tf
    from _common import best_seconds

    import hvdkit
    from hvdkit.fault import _state_broadcast

    hvdkit.init()
    rows = []
    for name, sizes in MODELS.items():
        rng = np.random.default_rng(hvdkit.rank())
        weights = [tf.Variable(rng.standard_normal(n).astype("float32")) for n in sizes]
        slots = [tf.Variable(np.zeros(n, "float32")) for n in sizes]
        values = [*weights, *slots, tf.Variable(np.int64(7))]
        head = {"ok": True, "state": {"step": 7, "sampler": list(range(100))}}

        def per_variable(values=values, head=head):
            hvdkit.broadcast_object(head, 0)
            hvdkit.broadcast_variables(values, 0)

        def packed(values=values, head=head):
            _state_broadcast.header(head, values)
            _state_broadcast.variables(values)

        per_variable(), packed()  # warm up: Horovod's first cycles, the ops' kernels
        times = {"per variable": [], "packed": []}
        for _ in range(repeats):
            times["per variable"].append(best_seconds(per_variable, 1))
            times["packed"].append(best_seconds(packed, 1))
        root = hvdkit.broadcast_object([v.numpy() for v in values], 0)
        mine = all(np.array_equal(v.numpy(), w) for v, w in zip(values, root, strict=True))
        same = all(hvdkit.allgather_object(mine))  # every rank holds rank 0's values
        rows.append(
            {
                "model": name,
                "variables": len(values),
                "megabytes": sum(4 * n for n in sizes) * 2 / 1e6,
                **{k: min(v) for k, v in times.items()},
                "equal_to_rank_0": bool(same),
            }
        )
    if hvdkit.rank() == 0:
        out.write_text(json.dumps({"size": hvdkit.size(), "rows": rows}))


def markdown_table(runs: list[dict]) -> str:
    head = "| ranks | variables like | variables | MB | per variable, s | packed, s | ratio |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["rows"]:
            ratio = r["per variable"] / r["packed"]
            lines.append(
                f"| {run['size']} | {r['model']} | {r['variables']} | {r['megabytes']:.1f} | "
                f"{r['per variable']:.3f} | {r['packed']:.3f} | {ratio:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--from", dest="from_", type=Path)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.repeats)
        return
    if args.from_ is not None:
        print(markdown_table(json.loads(args.from_.read_text())["runs"]))
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.np:
            out = Path(tmp) / f"np{n}.json"
            me = [sys.executable, __file__, "--worker", str(out), "--repeats", str(args.repeats)]
            cmd = [str(Path(sys.executable).parent / "hvdkitrun"), "-np", str(n), "--gloo", *me]
            subprocess.run(cmd, env=job_env(REPO, REPO / "benchmarks"), check=True)
            runs.append(json.loads(out.read_text()))
    path = write_results(
        "state_broadcast",
        {
            "what": "seconds to send rank 0's state to every rank (fewest of the repeats)",
            "runs": runs,
        },
    )
    print(markdown_table(runs))
    print(f"wrote {path}")
    if not all(r["equal_to_rank_0"] for run in runs for r in run["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
