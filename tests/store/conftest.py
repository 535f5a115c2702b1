import pytest

from kcache.store import open_store


@pytest.fixture(params=["file"])
def any_store(request, tmp_path):
    """Every backend the conformance suite covers (s3 joins once it exists)."""
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    raise AssertionError(request.param)
