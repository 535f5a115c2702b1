"""/metrics from markers that other containers wrote with hostile values: the exposition must stay
valid text format 0.0.4, one sample per line, and counts must stay counts."""

import re

from kcache import metrics
from kcache.readiness import RESTORE_MARKER, WARMUP_MARKER, WATCH_MARKER, write_marker

EVIL = 'm"odel\\\nkcache_ready 1\r\u2028{x="y"}\x00\ud800\x1b[2J'
# name{label="value",...} number: a value is any text with \\, \" and \n escaped, nothing raw.
SAMPLE = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\\n]|\\[\\"n])*",?)+\})? -?[0-9.e+]+$')


def test_hostile_label_text_keeps_one_sample_per_line(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": EVIL, "bundle_key": EVIL, "model": EVIL})
    write_marker(tmp_path, WARMUP_MARKER, {"status": EVIL, "profiles": [{"name": EVIL}]})
    write_marker(tmp_path, WATCH_MARKER, {"new_files": {EVIL: 1, "inductor": 2}, "new_bytes": {EVIL: 3}})
    text = metrics.render(metrics.collect(tmp_path))
    text.encode("utf-8")  # a lone surrogate would fail the scrape here
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples and all(SAMPLE.match(line) for line in samples), [s for s in samples if not SAMPLE.match(s)]
    assert sum(line.startswith("kcache_ready ") for line in samples) == 1


def test_negative_counts_from_a_marker_are_left_out(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "files": -3, "seconds": 2})
    watch = {"baseline_files": -1, "new_files": {"inductor": -5, "triton": 2}, "new_bytes": {"triton": -1},
             "publishes": -7, "publish_errors": 4}  # fmt: skip
    write_marker(tmp_path, WATCH_MARKER, watch)
    text = metrics.render(metrics.collect(tmp_path))
    assert "kcache_restore_files" not in text and "kcache_restore_seconds 2" in text
    assert 'kcache_jit_files_after_ready{layer="inductor"}' not in text
    assert 'kcache_jit_files_after_ready{layer="triton"} 2' in text
    assert 'kcache_jit_bytes_after_ready{layer="triton"}' not in text
    # A counter that went negative would read as a reset to rate(): a damaged marker counts from zero.
    assert "kcache_watch_publishes_total 0" in text and "kcache_watch_publish_errors_total 4" in text
    assert "kcache_watch_baseline_files 0" in text
