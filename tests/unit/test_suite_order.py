"""The suite's own scheduling: the longest files are named as they are on disk."""

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
