"""``hvdkit.init()`` collects, then freezes what is alive (runtime._freeze_startup_objects)."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import hvdkit
from hvdkit import config, runtime


class Finalized:
    """An object in a reference cycle (only the collector frees it) that notes its end."""

    def __init__(self, seen: list, name: str):
        self.me, self.seen, self.name = self, seen, name

    def __del__(self):
        self.seen.append(self.name)


@pytest.fixture
def first_init(monkeypatch):
    """This process as before its first init(), with automatic collections off."""
    for var in (*config.LAUNCHER_SIZE_VARS, config.BACKEND, config.GC_FREEZE):
        monkeypatch.delenv(var, raising=False)
    hvdkit.shutdown()
    monkeypatch.setattr(runtime, "_frozen", False)
    monkeypatch.setattr(runtime, "_frozen_files", [])
    gc.disable()  # only init()'s own collection may free what the test leaves
    try:
        yield
    finally:
        gc.enable()
        hvdkit.shutdown()
        gc.unfreeze()  # this pytest process as the other tests found it (never frozen twice)


def test_the_first_init_finalizes_garbage_and_freezes_the_living_once(first_init):
    seen: list[str] = []
    Finalized(seen, "garbage")
    alive = Finalized(seen, "alive")
    frozen_before = gc.get_freeze_count()
    hvdkit.init()
    assert seen == ["garbage"]  # finalized by init's collection, not frozen
    assert gc.get_freeze_count() > frozen_before
    del alive
    gc.collect()
    assert seen == ["garbage"]  # frozen: left to the process's end
    Finalized(seen, "made after init")
    gc.collect()
    assert seen == ["garbage", "made after init"]  # collected as before
    hvdkit.shutdown()
    Finalized(seen, "before a second init")
    frozen = gc.get_freeze_count()
    hvdkit.init()  # once per process: no second collection or freeze
    assert seen == ["garbage", "made after init"] and gc.get_freeze_count() <= frozen


def test_hvdkit_gc_freeze_0_leaves_the_collector_alone_and_bad_values_are_named(
    first_init, monkeypatch
):
    seen: list[str] = []
    monkeypatch.setenv(config.GC_FREEZE, "yes")
    with pytest.raises(hvdkit.ConfigurationError, match="HVDKIT_GC_FREEZE='yes' is not 0 or 1"):
        hvdkit.init()
    assert not hvdkit.is_initialized()
    monkeypatch.setenv(config.GC_FREEZE, "0")
    Finalized(seen, "garbage")
    frozen = gc.get_freeze_count()
    hvdkit.init()
    assert seen == [] and gc.get_freeze_count() == frozen and not runtime._frozen
    gc.collect()
    assert seen == ["garbage"]


def test_unclosed_files_are_written_out_at_exit(tmp_path):
    """Files held in reference cycles that the script's globals still reach at exit:
    Python's finalization writes them out; with the freeze, hvdkit's exit flush does.
    One opened before init() (frozen), one after."""
    script = textwrap.dedent(
        """
        import gc, io, sys
        class Holder:
            def __init__(self, path, text):
                self.me, self.file = self, open(path, "w")
                self.file.write(text)
        before = Holder(sys.argv[1], "opened before init")
        import hvdkit
        hvdkit.init()
        after = Holder(sys.argv[2], "opened after init")
        before.file.write(", written after")
        detached = io.TextIOWrapper(io.BytesIO())
        detached.detach()  # its `closed` raises: the exit flush must pass over it
        print(gc.get_freeze_count())
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in config.LAUNCHER_SIZE_VARS}
    paths = [tmp_path / "before.txt", tmp_path / "after.txt"]
    for freeze in ("1", "0"):
        env[config.GC_FREEZE] = freeze
        done = subprocess.run(
            [sys.executable, "-c", script, *map(str, paths)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Exception ignored" not in done.stderr, done.stderr[-2000:]
        texts = [p.read_text() for p in paths]
        assert texts == ["opened before init, written after", "opened after init"], freeze
        frozen = int(done.stdout.split()[-1])
        # TensorFlow's and Keras's modules (runtime imports TensorFlow): 300 000+ here
        assert frozen > 100_000 if freeze == "1" else frozen == 0


def test_the_exit_flush_writes_files_on_disk_only_and_survives_odd_objects(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "_frozen", True)
    monkeypatch.setattr(runtime, "_frozen_files", [])
    on_disk = open(tmp_path / "on_disk.txt", "w")
    read_end, write_end = os.pipe()
    pipe = open(write_end, "wb")
    os.set_blocking(read_end, False)
    try:
        on_disk.write("buffered")
        pipe.write(b"buffered")
        assert list(runtime._files_among([1, "text", on_disk, pipe])) == [on_disk, pipe]
        runtime._flush_files_at_exit()
        assert (tmp_path / "on_disk.txt").read_text() == "buffered"
        with pytest.raises(BlockingIOError):  # a pipe is left alone (a flush may block)
            os.read(read_end, 100)
    finally:
        on_disk.close()
        pipe.close()
        os.close(read_end)
