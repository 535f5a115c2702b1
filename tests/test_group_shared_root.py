"""A restore root shared through a group (Kubernetes fsGroup): the model container, running as
another user of that group, must be able to compile into every layer restore laid out.

The restore runs as this test's user (root, umask 022); the model is a child process switched to
an unprivileged uid in the group, running plain shell commands the way a compiler would write:
new files, new directories, temp files, and atomic replacement of a restored file.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from trees import write_tree

from kcache import sources
from kcache.publish import publish
from kcache.restore import read_state, restore
from kcache.sources.base import torch_user

GROUP = 4242  # the pod's fsGroup
MODEL_UID = 1001  # the model container's user: not the restoring one, in the group

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")

WRITER = r"""
set -e
for layer in inductor triton cuda vllm tmp; do
  echo compiled > "$ROOT/$layer/new-by-model"
  mkdir "$ROOT/$layer/newdir" && echo k > "$ROOT/$layer/newdir/kernel"
done
TMPDIR="$ROOT/tmp" mktemp > /dev/null
mkdir -p "$ROOT/tmp/torchinductor_model/precompiled_headers"
if [ -f "$ROOT/inductor/fxgraph/g" ]; then
  cat "$ROOT/inductor/fxgraph/g" "$ROOT/inductor/ab/kernel.so" > /dev/null
  echo replaced > "$ROOT/inductor/fxgraph/.g.tmp" && mv -f "$ROOT/inductor/fxgraph/.g.tmp" "$ROOT/inductor/fxgraph/g"
  echo more > "$ROOT/triton/k/new.cubin"
fi
"""


def as_model_user() -> None:
    os.setgroups([GROUP])
    os.setgid(GROUP)
    os.setuid(MODEL_UID)
    os.umask(0o022)


@pytest.fixture
def shared_root():
    """ROOT on a volume the way fsGroup leaves it: group GROUP, setgid, group-writable."""
    base = Path(tempfile.mkdtemp(prefix="kcache-fsgroup-"))  # not under pytest's 0700 tmp
    base.chmod(0o755)
    root = base / "root"
    root.mkdir()
    os.chown(root, 0, GROUP)
    root.chmod(0o2775)
    yield root
    shutil.rmtree(base)


@pytest.mark.parametrize("outcome", ["hit", "miss"])
def test_model_user_in_the_group_can_compile_into_a_restored_root(tmp_path, store, sqlite_index, fp, shared_root,
                                                                  outcome):  # fmt: skip
    if outcome == "hit":
        header = f"tmp/torchinductor_{torch_user()}/precompiled_headers/h.gch"
        write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph", "triton/k/kernel.cubin": b"cubin",
                                      "inductor/ab/kernel.so": (b"so", 0o700),  # the owner's only, as g++ left it
                                      header: b"pch"})  # fmt: skip
        publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    old_umask = os.umask(0o022)
    try:
        assert restore(store, sqlite_index, fp, shared_root).status == outcome
    finally:
        os.umask(old_umask)
    assert read_state(shared_root)["status"] == outcome

    directories = [p for p in shared_root.rglob("*") if p.is_dir()]
    done = subprocess.run(["/bin/sh", "-c", WRITER], env={"ROOT": str(shared_root), "PATH": os.environ["PATH"]},
                          preexec_fn=as_model_user, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for path in directories:  # group-writable, and new entries keep the group
        st = path.stat()
        assert st.st_gid == GROUP and stat.S_IMODE(st.st_mode) & 0o2070 == 0o2070, (path, oct(st.st_mode))
    if outcome == "hit":
        assert (shared_root / "inductor/fxgraph/g").read_text() == "replaced\n"


def test_root_that_is_not_group_shared_keeps_the_umask(tmp_path, store, sqlite_index, fp):
    old_umask = os.umask(0o022)
    try:
        restore(store, sqlite_index, fp, tmp_path / "root")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "root/inductor").stat().st_mode) == 0o755


def test_lock_left_by_another_user_still_serializes(shared_root):
    """The init container ran as root once, as the model's user now: the lock file is not theirs."""
    from kcache import rootdir

    with rootdir.locked(shared_root, None, None):
        pass
    assert (shared_root / rootdir.LOCK_NAME).stat().st_uid == 0
    pid = os.fork()
    if pid == 0:  # the child only makes system calls of modules already imported
        code = 1
        try:
            as_model_user()
            with rootdir.locked(shared_root, 5.0, None):
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
