import pytest

from kcache.store import open_store


@pytest.fixture(params=["file", "s3", "node-cache"])
def any_store(request, tmp_path):
    """Every backend the conformance suite covers, and the node cache wrapper in front of one."""
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    if request.param == "node-cache":
        from kcache.store.nodecache import NodeCacheStore

        return NodeCacheStore(open_store(f"file://{tmp_path / 'store'}"), tmp_path / "node-cache")
    return request.getfixturevalue("s3_store")
