"""Settings resolution (flag, env, default, with origins) and the one credential redactor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcache import config
from kcache.config import MASK, redact_text, redact_url
from kcache.errors import ConfigError, IndexDbError, StoreError

SECRET = "Zq9xSecretPw"


@pytest.mark.parametrize(
    "url, shown",
    [
        (f"postgresql+psycopg://kcache:{SECRET}@db:5432/kcache", "postgresql+psycopg://kcache:***@db:5432/kcache"),
        (f"postgresql://db/kcache?user=k&password={SECRET}&sslmode=require",
         "postgresql://db/kcache?user=k&password=***&sslmode=require"),
        (f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix", "s3://AKIAEXAMPLE:***@bucket/prefix"),
        (f"https://s3.example/b/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature={SECRET}&x=1",
         "https://s3.example/b/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1"),
        (f"https://host/v1?token={SECRET}", "https://host/v1?token=***"),
        ("sqlite:////home/me/.cache/kcache/index.db", "sqlite:////home/me/.cache/kcache/index.db"),
        ("postgresql://kcache@db/kcache", "postgresql://kcache@db/kcache"),  # a user alone is no secret
        ("file:///srv/store", "file:///srv/store"),
    ],
)  # fmt: skip
def test_redact_url(url, shown):
    assert redact_url(url) == shown


@given(st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=%", min_size=8))
def test_no_password_survives_redaction(password):
    assert MASK in redact_url(f"postgresql://u:{password}@h:5432/db")
    text = f"index postgresql+psycopg://u:{password}@h/db: cannot connect"
    assert f":{password}@" not in redact_text(text)


def test_redact_text_finds_urls_inside_messages():
    text = f"store 's3://a:{SECRET}@b/p' and (https://u:{SECRET}@h/x) failed"
    assert SECRET not in redact_text(text) and "s3://a:***@b/p" in redact_text(text)


@pytest.mark.parametrize(
    "exc",
    [
        IndexDbError(f"postgresql://u:{SECRET}@h/db", f"cannot connect to postgresql://u:{SECRET}@h/db"),
        StoreError(f"s3://k:{SECRET}@b/p", "denied"),
        ConfigError("index URL", f"postgresql://u:{SECRET}@h/db", f"bad (postgresql://u:{SECRET}@h/db)"),
    ],
)
def test_errors_that_quote_urls_redact_them_but_keep_the_field(exc):
    assert SECRET not in str(exc)
    assert SECRET in (getattr(exc, "url", None) or exc.value)


def test_origins_flag_env_default():
    env = {"KCACHE_HOME": "/h", "KCACHE_INDEX": "sqlite:////x.db"}
    cfg = config.resolve(store="file:///s", env=env)
    assert cfg.origin("store") == "flag" and cfg.origin("index") == "env KCACHE_INDEX"
    assert cfg.origin("home") == "env KCACHE_HOME" and cfg.origin("endpoint") == "default"
    assert cfg.index_explicit and cfg.store_url == "file:///s"
    named = config.resolve(store="file:///s", env=env, origins={"store": "flag --store"})
    assert named.origin("store") == "flag --store"


def test_s3_specific_endpoint_wins_as_in_boto3():
    env = {"KCACHE_HOME": "/h", "AWS_ENDPOINT_URL": "http://general", "AWS_ENDPOINT_URL_S3": "http://s3-only"}
    cfg = config.resolve(env=env)
    assert cfg.s3_endpoint_url == "http://s3-only" and cfg.origin("endpoint") == "env AWS_ENDPOINT_URL_S3"
    assert config.resolve(env={"KCACHE_HOME": "/h", "AWS_ENDPOINT_URL": "http://g"}).s3_endpoint_url == "http://g"


def test_home_that_is_a_file_is_a_config_error(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="KCACHE_HOME"):
        config.resolve(env={"KCACHE_HOME": str(tmp_path / "f")})


def test_a_user_without_a_home_still_gets_settings(tmp_path, monkeypatch):
    """An arbitrary uid in a container: no HOME, no passwd entry. A restore given --store and
    --index none must still run, so the defaults fall back to the temp dir."""
    import os
    import pwd
    import tempfile

    from kcache.config import resolve

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = resolve(store=f"file://{tmp_path / 'store'}", index="none", env={})
    assert cfg.home == tmp_path / f"kcache-{os.getuid()}" and cfg.store_url == f"file://{tmp_path / 'store'}"
