import pytest

import hvdkit


@pytest.fixture
def local_runtime(monkeypatch):
    """A size-1 hvdkit runtime, shut down after the test (runtime state is global)."""
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HVDKIT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    hvdkit.shutdown()
    hvdkit.init()
    yield
    hvdkit.shutdown()
