import pytest

from kcache.store import open_store


@pytest.fixture(params=["file", "s3"])
def any_store(request, tmp_path):
    """Every backend the conformance suite covers."""
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    return request.getfixturevalue("s3_store")
