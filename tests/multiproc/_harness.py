"""Shared by the scripts in this folder, which run under a launcher with 2 ranks.

Each script records named checks; on the first failure it prints the reason and
exits 1, so the launcher (and pytest) see a non-zero status. At the end every
rank writes ``<outdir>/rank<r>.json`` with the names of the checks it passed
and any values the pytest side compares across ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class Checks:
    def __init__(self, rank: int, outdir: str):
        self.rank = rank
        self.outdir = outdir
        self.passed: list[str] = []
        self.values: dict = {}

    @contextlib.contextmanager
    def check(self, name: str):
        try:
            yield
        except Exception:
            msg = f"[rank {self.rank}] CHECK FAILED: {name}\n{traceback.format_exc()}"
            os.write(2, msg.encode())
            sys.stdout.flush()
            os._exit(1)  # do not wait for peers: the launcher tears the job down
        self.passed.append(name)

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

    def finish(self) -> None:
        path = os.path.join(self.outdir, f"rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump({"rank": self.rank, "passed": self.passed, "values": self.values}, f)
        os.write(1, f"[rank {self.rank}] {len(self.passed)} checks passed\n".encode())
