"""The suite's own machinery: the longest files first, and reference jobs shared by files."""

from pathlib import Path

from conftest import SLOW_FILES_FIRST, pytest_collection_modifyitems

TESTS = Path(__file__).resolve().parents[1]


def test_every_file_started_first_exists_once():
    assert len(set(SLOW_FILES_FIRST)) == len(SLOW_FILES_FIRST)
    missing = [name for name in SLOW_FILES_FIRST if not (TESTS / name).is_file()]
    assert missing == [], (
        f"renamed or gone: {missing}; update SLOW_FILES_FIRST in tests/conftest.py"
    )


class _Item:
    def __init__(self, name, test):
        self.path, self.test = TESTS / name, test


def test_the_longest_files_come_first_and_the_rest_keep_their_order():
    slow, second = SLOW_FILES_FIRST[0], SLOW_FILES_FIRST[1]
    names = ["unit/test_a.py", second, "unit/test_b.py", slow, second, "unit/test_a.py"]
    items = [_Item(name, i) for i, name in enumerate(names)]
    pytest_collection_modifyitems(items)
    assert [item.test for item in items] == [3, 1, 4, 0, 2, 5]
    backwards = [_Item(name, i) for i, name in reversed(list(enumerate(names)))]
    pytest_collection_modifyitems(backwards)
    assert [item.test for item in backwards] == [3, 4, 1, 5, 2, 0]  # stable within a rank


def _blocked_on(path) -> int:
    """How many processes wait for a flock on ``path`` (/proc/locks)."""
    import os

    inode = os.stat(path).st_ino
    lines = open("/proc/locks").read().splitlines()
    return sum("->" in ln and ln.split()[6].endswith(f":{inode}") for ln in lines)


def _ask(base, worker, log):
    """One xdist worker asking for the shared folder (a child process)."""
    import os
    import time

    from conftest import shared_folder

    os.environ["PYTEST_XDIST_WORKER"] = worker

    class Factory:  # what shared_folder reads of pytest's TempPathFactory
        @staticmethod
        def getbasetemp():
            return base / f"popen-{worker}"

    def make(folder):
        with open(log, "a") as f:
            f.write(f"{worker}\n")
        # hold the job until the two other workers wait for the lock (at most 20 s:
        # without the lock they would make it too, meanwhile)
        deadline = time.monotonic() + 20
        while _blocked_on(base / "shared" / "ref.lock") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (folder / "result").write_text("made")

    print(shared_folder(Factory, "ref", make))


def test_a_shared_folder_is_made_once_for_all_workers(tmp_path):
    """conftest.shared_folder: three xdist workers asking at once get one folder, made
    once: the first makes it while the two others wait for the lock."""
    import multiprocessing

    log = tmp_path / "made"
    ctx = multiprocessing.get_context("spawn")
    workers = [f"gw{i}" for i in range(3)]
    asks = [ctx.Process(target=_ask, args=(tmp_path, w, log)) for w in workers]
    for w, p in zip(workers, asks, strict=True):
        (tmp_path / f"popen-{w}").mkdir()
        p.start()
    for p in asks:
        p.join(60)
    assert [p.exitcode for p in asks] == [0, 0, 0]
    assert len(log.read_text().splitlines()) == 1  # one worker made it
    assert (tmp_path / "shared" / "ref" / "result").read_text() == "made"
