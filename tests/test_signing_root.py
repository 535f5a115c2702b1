"""A command that signs must sign nothing a store writer planted.

`publish --from ROOT` and `watch` sign every file of ROOT. A restore into ROOT that checked no
signature (no --require-signature, a kept ROOT) may have laid down a bundle a store writer published
without the key: signed by the next publish, it reached every pod that requires signatures.
"""

import json
import os

from click.testing import CliRunner
from planted import PLANTED, publish_planted
from trees import write_tree

from kcache import envfile
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.readiness import WARMUP_MARKER, write_marker
from kcache.watch import ready_time


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def planted_root(tmp_path):
    """ROOT restored, with no signature check, from the bundle a store writer planted; the key `ci` made."""
    publish_planted(tmp_path)
    root = tmp_path / "root"
    assert run("restore", "--into", str(root), "--model", "m").exit_code == 0
    assert (root / PLANTED).exists()
    assert run("keygen", "ci", "--dir", str(tmp_path / "k")).exit_code == 0
    return root


def signed_pod(tmp_path):
    """What a pod requiring `ci`'s signature restores: its status and whether it holds the planted file."""
    pod = tmp_path / "pod"
    out = run("restore", "--into", str(pod), "--model", "m", "--trusted-key", str(tmp_path / "k" / "ci.pub"),
              "--require-signature", "--json")  # fmt: skip
    return json.loads(out.stdout)["status"], (pod / PLANTED).exists()


def test_a_signing_publish_from_a_root_restored_from_a_planted_bundle_refuses(tmp_path):
    root = planted_root(tmp_path)
    write_tree(root, {"inductor/kernel.so": b"\x7fELF"})  # compiled in the pod over the planted layer
    out = run("publish", "--from", str(root), "--model", "m", "--signing-key", str(tmp_path / "k" / "ci.key"))
    assert out.exit_code == ExitCode.SIGNATURE, out.output
    assert "'ci' did not sign it" in out.output and "--require-signature" in out.output
    assert signed_pod(tmp_path) == ("error", False)  # the newest bundle is unsigned: refused
    # Without a key nothing is vouched for: publish is as before.
    assert run("publish", "--from", str(root), "--model", "m").exit_code == 0


def test_a_signing_publish_of_the_live_directories_a_planted_restore_filled_refuses(tmp_path, monkeypatch):
    """`kcache publish` with no --from, in a pod that sourced ROOT/kcache.env: its live cache directories are
    ROOT's layers, and it signed the planted file as `publish --from ROOT` did."""
    root = planted_root(tmp_path)
    for name, value in envfile.read(root / envfile.NAME).items():
        monkeypatch.setenv(name, value)
    write_tree(root, {"inductor/kernel.so": b"\x7fELF"})
    out = run("publish", "--model", "m", "--signing-key", str(tmp_path / "k" / "ci.key"))
    assert out.exit_code == ExitCode.SIGNATURE, out.output
    assert "'ci' did not sign it" in out.output
    assert signed_pod(tmp_path) == ("error", False)  # the newest bundle is unsigned: refused


def test_a_signing_watch_over_a_root_restored_from_a_planted_bundle_signs_none_of_it(tmp_path):
    root = planted_root(tmp_path)
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    os.utime(root / PLANTED, (ready_time(root) - 1,) * 2)
    assert run("watch", "--root", str(root), "--once").exit_code == 0  # the baseline
    write_tree(root, {"inductor/late.so": b"\x7fELF"})
    out = run("watch", "--root", str(root), "--once", "--json", "--publish-every", "10m", "--model", "m",
              "--signing-key", str(tmp_path / "k" / "ci.key"))  # fmt: skip
    assert out.exit_code == ExitCode.PUBLISH, out.output
    doc = json.loads(out.stdout)
    assert not doc["published"] and "'ci' did not sign it" in doc["publish_error"]
    assert signed_pod(tmp_path) == ("error", False)  # the newest bundle is unsigned: refused


def test_a_signing_publish_from_a_root_restored_from_its_own_signed_bundle_signs_it(tmp_path):
    """The check looks at what the restore laid down: a bundle the key signed is published again, signed."""
    root = tmp_path / "root"
    write_tree(root, {"inductor/first.so": b"\x7fELF1"})
    assert run("keygen", "ci", "--dir", str(tmp_path / "k")).exit_code == 0
    key = str(tmp_path / "k" / "ci.key")
    assert run("publish", "--from", str(root), "--model", "m", "--signing-key", key).exit_code == 0
    kept = tmp_path / "kept"
    assert run("restore", "--into", str(kept), "--model", "m").exit_code == 0  # unchecked, but of a signed bundle
    write_tree(kept, {"inductor/second.so": b"\x7fELF2"})
    out = run("publish", "--from", str(kept), "--model", "m", "--signing-key", key)
    assert out.exit_code == 0, out.output
    assert signed_pod(tmp_path)[0] == "hit" and (tmp_path / "pod" / "inductor" / "second.so").exists()
