"""Shared by the scripts in this folder, which run under a launcher with 2 ranks.

Each script records named checks. A failed check is recorded with its
traceback and the script goes on to the next one, so that pytest reports
every check as its own item (see ``WorkerRun`` in ``tests/conftest.py``).
After every check each rank rewrites ``<outdir>/rank<r>.json``, so a job
that dies or hangs later still reports what it reached. The script exits 1
at ``finish()`` when any check failed.

A failure inside a collective may leave the ranks out of step; the checks
after it can then hang, and the pytest side ends the job after its timeout
and reports those checks as not reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class Checks:
    def __init__(self, rank: int, outdir: str):
        self.rank = rank
        self.outdir = outdir
        # name -> {"ok": bool, "error": str, "s": seconds the check took on this rank}
        self.results: dict[str, dict] = {}
        self.values: dict = {}

    @property
    def passed(self) -> list[str]:
        return [name for name, r in self.results.items() if r["ok"]]

    @contextlib.contextmanager
    def check(self, name: str):
        if name in self.results:
            raise ValueError(f"check {name!r} recorded twice; give each check its own name")
        start = time.perf_counter()
        try:
            yield
        except Exception:
            error = traceback.format_exc()
            os.write(2, f"[rank {self.rank}] CHECK FAILED: {name}\n{error}".encode())
            self.results[name] = {"ok": False, "error": error[-4000:]}
        else:
            self.results[name] = {"ok": True, "error": ""}
        self.results[name]["s"] = round(time.perf_counter() - start, 2)
        self._write()

    @staticmethod
    def expect_errors(cases, error_type) -> None:
        """Each ``(call, fragment)``: calling raises ``error_type`` mentioning ``fragment``."""
        for call, fragment in cases:
            try:
                call()
            except error_type as e:
                assert fragment in str(e), (fragment, str(e))
            else:
                raise AssertionError(f"no {error_type.__name__} for: {fragment}")

    def record(self, key: str, value) -> None:
        self.values[key] = value
        self._write()

    def _write(self) -> None:
        path = os.path.join(self.outdir, f"rank{self.rank}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "rank": self.rank,
                    "results": self.results,
                    "passed": self.passed,
                    "values": self.values,
                },
                f,
            )
        os.replace(tmp, path)

    def finish(self) -> None:
        self._write()
        failed = [n for n, r in self.results.items() if not r["ok"]]
        summary = f"[rank {self.rank}] {len(self.passed)} checks passed, {len(failed)} failed\n"
        os.write(1, summary.encode())
        if failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
