import pytest

from kcache.errors import ConfigError, StoreError
from kcache.store import open_store
from kcache.store.local import LocalStore


def test_file_urls_and_bare_paths(tmp_path):
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store(str(tmp_path)), LocalStore)


@pytest.mark.parametrize("url", ["ftp://x/y", "gs://bucket", "file://host/path", "s3:///nobucket"])
def test_unusable_urls_name_the_problem(url):
    with pytest.raises(ConfigError) as info:
        open_store(url)
    assert url in str(info.value)


def test_store_root_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        open_store(f"file://{tmp_path / 'f'}")
