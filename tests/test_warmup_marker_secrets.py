"""The warmup marker never holds a password: --url may carry one (http://user:pass@host), and the
marker under ROOT is read by every container of the pod and shown by `kcache ready --json`."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kcache import warmup
from kcache.cli import main
from kcache.profiles import Profile

URL = "http://svc:s3cr3t-pw@127.0.0.1:9"


def test_warmup_marker_redacts_credentials_in_target_and_errors(tmp_path):
    failed = warmup.ProfileResult(Profile("p", 1, 8, 8), False, (), error=f"POST {URL}/v1/completions: refused")
    report = warmup.WarmupReport("failed", URL, 1.0, (failed,), error=f"cannot reach {URL}/health")
    marker = warmup.write_marker(tmp_path, report)
    text = marker.read_text()
    assert "s3cr3t-pw" not in text and "svc" in text and "127.0.0.1:9" in text


def test_warmup_with_a_password_in_url_leaves_no_password_under_root(tmp_path):
    root = tmp_path / "root"
    result = CliRunner().invoke(main, ["warmup", "--url", URL, "--root", str(root), "--wait-timeout", "1", "--json"])
    assert result.exit_code != 0
    assert "s3cr3t-pw" not in result.output
    for path in root.iterdir():
        assert "s3cr3t-pw" not in path.read_text(), path
    assert (root / ".kcache-warmup.json").exists()


def test_a_quote_after_a_secret_query_value_in_server_text_leaves_a_readable_marker(tmp_path):
    """Redacting the serialised JSON cut the backslash before an escaped quote along with the
    secret: the marker could not be written and warmup exited as a bug."""
    from kcache.cli.warmup_cmd import _report_json

    said = 'HTTP 503: loading; see http://status.internal/?token=abc"def and http://u:pw@h/?sig=x\\"y'
    failed = warmup.ProfileResult(Profile("p", 1, 8, 8), False, (), error=said)
    report = warmup.WarmupReport("failed", URL, 1.0, (failed,), error=said)
    marker = json.loads(warmup.write_marker(tmp_path, report).read_text())
    shown = _report_json(report)
    for doc in (marker, shown):
        text = json.dumps(doc)
        assert "abc" not in text and ":pw@" not in text and "s3cr3t-pw" not in text
        assert 'def and' in doc["error"] and "status.internal" in doc["error"]
