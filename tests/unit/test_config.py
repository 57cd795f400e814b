"""Settings read through config's typed readers: their defaults and refusals."""

from __future__ import annotations

import pytest

from hvdkit import config
from hvdkit.errors import ConfigurationError


@pytest.mark.parametrize(("raw", "expected"), [(None, 0), ("0", 0), ("3", 3)])
def test_restart_count(monkeypatch, raw, expected):
    """The launcher's round, read by one typed reader (elastic, runtime)."""
    if raw is None:
        monkeypatch.delenv(config.RESTART_COUNT, raising=False)
    else:
        monkeypatch.setenv(config.RESTART_COUNT, raw)
    assert config.restart_count() == expected


@pytest.mark.parametrize("raw", ["-1", "1.5", "two"])
def test_restart_count_refuses_what_is_not_a_round(monkeypatch, raw):
    monkeypatch.setenv(config.RESTART_COUNT, raw)
    with pytest.raises(ConfigurationError) as info:
        config.restart_count()
    assert str(info.value) == f"HVDKIT_RESTART_COUNT={raw!r} is not a round number (an int >= 0)."
