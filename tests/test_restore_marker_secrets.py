"""A restore that fails on an error quoting a URL with a password (a driver's own message, a
kcache bug's) leaves no password in the marker, kcache.env or the index: every container of the
pod reads ROOT, and `kcache ready --json` shows the marker."""

from __future__ import annotations

import pytest

from kcache import envfile
from kcache.restore import read_state, restore_opening


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_failure_reason_is_redacted_everywhere_under_root(tmp_path, error):
    def open_inputs():
        raise error("could not connect to postgresql://kcache:hunter2-pw@db:5432/kcache")

    with pytest.raises(error):
        restore_opening(open_inputs, tmp_path / "root", timeout=30)
    state = read_state(tmp_path / "root")
    assert state["status"] == "error" and "db:5432" in state["reason"]
    for path in (tmp_path / "root").iterdir():
        if path.is_file():
            assert "hunter2-pw" not in path.read_text(), path
    assert (tmp_path / "root" / envfile.NAME).exists()
