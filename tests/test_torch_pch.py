"""kcache.torch.pch without a compile: what it records, what it trusts in a restored root, and what
it makes of a hostile kcache-headers.json (it comes from the store). The real torch run is in
tests/test_torch_restore.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kcache.readiness import RESTORE_MARKER, write_marker
from kcache.torch import pch

NAME = "a" * 52 + ".h"


class Isa:
    """Like torch's VecISA: its repr holds an address, its str is the ISA."""

    def __str__(self) -> str:
        return "avx2"


def layout(tmp_path, *, marker: dict | None = None, recorded: dict | None = None):
    """ROOT with a header dir holding one header and its .gch, optionally a record, then the marker."""
    root = tmp_path / "root"
    headers = root / "tmp" / "torchinductor_u" / "precompiled_headers"
    headers.mkdir(parents=True)
    (headers / NAME).write_text("#include <torch/x.h>\n")
    (headers / f"{NAME}.gch").write_bytes(b"gch")
    if recorded is not None:
        (headers / pch.NAME).write_text(json.dumps({"schema": 1, "headers": recorded}))
    if marker is not None:
        write_marker(root, RESTORE_MARKER, marker)
    return root, headers


def calls_of(original_result: str):
    calls: list[tuple] = []

    def original(header, cmd, **options):
        calls.append((header, cmd, options))
        return original_result

    return original, calls


def restored_root(root, headers):
    return pch._restored_root(headers, {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")})


KEY = pch.request_key("torch/x.h", "g++ -O3", {"vec_isa": Isa(), "shared": True})
HIT = {"status": "hit", "layers": ["inductor", "inductor-pch"]}


def test_the_request_key_is_the_same_in_every_process():
    code = ("from kcache.torch import pch\nclass Isa:\n    def __str__(self): return 'avx2'\n"
            f"Isa.__module__ = {Isa.__module__!r}\n"
            "print(pch.request_key('torch/x.h', 'g++ -O3', {'shared': True, 'vec_isa': Isa()}))")  # fmt: skip
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert KEY == other


def test_outside_a_restored_root_torch_answers_and_the_answer_is_recorded(tmp_path):
    root, headers = layout(tmp_path)
    original, calls = calls_of(str(headers / NAME))
    answer = pch._answering(original, headers, None)
    assert answer("torch/x.h", "g++ -O3", vec_isa=Isa(), shared=True) == str(headers / NAME) and len(calls) == 1
    assert json.loads((headers / pch.NAME).read_text()) == {"schema": 1, "headers": {KEY: NAME}}


@pytest.mark.parametrize("status", ["hit", "partial"])  # partial: --fallback toolchain or layers, same toolchain
def test_in_a_restored_root_a_recorded_header_is_named_without_asking_torch(tmp_path, status):
    root, headers = layout(tmp_path, recorded={KEY: NAME}, marker={**HIT, "status": status})
    original, calls = calls_of("unused")
    answer = pch._answering(original, headers, restored_root(root, headers))
    assert answer("torch/x.h", "g++ -O3", vec_isa=Isa(), shared=True) == os.path.join(str(headers), NAME)
    assert calls == []
    other = answer("torch/x.h", "g++ -O2", vec_isa=Isa(), shared=True)  # other flags: torch answers
    assert other == "unused" and len(calls) == 1
    assert json.loads((headers / pch.NAME).read_text()) == {"schema": 1, "headers": {KEY: NAME}}  # not rewritten


@pytest.mark.parametrize("case", ["miss marker", "no pch layer", "partial without it", "file after the restore",
                                  "gch missing"])  # fmt: skip
def test_a_record_nothing_vouches_for_is_not_used(tmp_path, case):
    marker = {"status": "miss", "layers": []} if case == "miss marker" else HIT
    if case in ("no pch layer", "partial without it"):
        marker = {"status": "hit" if case == "no pch layer" else "partial", "layers": ["inductor"]}
    root, headers = layout(tmp_path, recorded={KEY: NAME} if case != "file after the restore" else None, marker=marker)
    if case == "file after the restore":  # written after the marker: not restored bytes
        (headers / pch.NAME).write_text(json.dumps({"schema": 1, "headers": {KEY: NAME}}))
        later = (root / RESTORE_MARKER).stat().st_mtime_ns + 10**9
        os.utime(headers / pch.NAME, ns=(later, later))
    if case == "gch missing":
        (headers / f"{NAME}.gch").unlink()
    original, calls = calls_of(str(headers / NAME))
    answer = pch._answering(original, headers, restored_root(root, headers))
    answer("torch/x.h", "g++ -O3", vec_isa=Isa(), shared=True)
    assert len(calls) == 1


@pytest.mark.parametrize("doc", [
    {"schema": 1, "headers": {KEY: "../../../etc/passwd.h"}},
    {"schema": 1, "headers": {KEY: "/abs/x.h"}},
    {"schema": 1, "headers": {KEY: NAME + ".gch"}},
    {"schema": 1, "headers": {"not-a-key": NAME}},
    {"schema": 2, "headers": {KEY: NAME}},
    {"schema": 1, "headers": [KEY, NAME]},
    [1, 2],
])  # fmt: skip
def test_a_hostile_record_names_no_header(tmp_path, doc):
    root, headers = layout(tmp_path, marker=HIT)
    (headers / pch.NAME).write_text(json.dumps(doc))
    os.utime(headers / pch.NAME, ns=(1, 1))
    assert pch._read(headers, root) == {}


def test_a_record_over_its_cap_is_not_read(tmp_path):
    root, headers = layout(tmp_path, marker=HIT)
    (headers / pch.NAME).write_text(json.dumps({"schema": 1, "headers": {KEY: NAME}, "pad": "x" * pch.MAX_BYTES}))
    os.utime(headers / pch.NAME, ns=(1, 1))
    assert pch._read(headers, root) == {}


@pytest.mark.parametrize("layers", [5, 1.5, {"inductor-pch": 1}, "inductor-pch"])
def test_a_marker_whose_layers_are_no_list_vouches_for_no_header(tmp_path, layers):
    (tmp_path / "inductor").mkdir()
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "layers": layers})
    assert restored_root(tmp_path, tmp_path / "inductor" / "headers") is None
