"""The hash ninja keeps in .ninja_log for each output's command, per the log's version line.

    v5 (ninja 1.10, 1.11), v6 (1.12)   MurmurHash64A, seed 0xDECAFBADDECAFBAD
    v7 (1.13)                          rapidhash, its default seed and secrets

Both read the command's bytes as little-endian 64-bit words (ninja on x86-64 and arm64). Written
from the algorithms' descriptions; tests/test_ninjabuild.py checks them against logs ninja writes.
"""

from __future__ import annotations

import struct

_M64 = (1 << 64) - 1

_MURMUR_SEED = 0xDECAFBADDECAFBAD
_MURMUR_M = 0xC6A4A7935BD1E995


def murmur64a(data: bytes) -> int:
    """MurmurHash64A (Austin Appleby's) with ninja's seed: .ninja_log v5 and v6."""
    n = len(data)
    h = (_MURMUR_SEED ^ (n * _MURMUR_M)) & _M64
    whole = n - n % 8
    for (k,) in struct.iter_unpack("<Q", data[:whole]):
        k = (k * _MURMUR_M) & _M64
        k ^= k >> 47
        h ^= (k * _MURMUR_M) & _M64
        h = (h * _MURMUR_M) & _M64
    if n % 8:
        h ^= int.from_bytes(data[whole:], "little")
        h = (h * _MURMUR_M) & _M64
    h ^= h >> 47
    h = (h * _MURMUR_M) & _M64
    return h ^ (h >> 47)


_RAPID_SEED = 0xBDD89AA982704029
_RAPID_SECRET = (0x2D358DCCAA6C78A5, 0x8BB84B93962EACC9, 0x4B33A62ED433D4A3)


def _mum(a: int, b: int) -> tuple[int, int]:
    r = a * b
    return r & _M64, r >> 64


def _mix(a: int, b: int) -> int:
    lo, hi = _mum(a, b)
    return lo ^ hi


def rapidhash(data: bytes, seed: int = _RAPID_SEED) -> int:
    """rapidhash (Nicolas De Carli's, its fast variant) on a little-endian machine: .ninja_log v7."""
    s0, s1, s2 = _RAPID_SECRET
    n = len(data)

    def r64(i: int) -> int:
        return int.from_bytes(data[i : i + 8], "little")

    def r32(i: int) -> int:
        return int.from_bytes(data[i : i + 4], "little")

    seed ^= _mix(seed ^ s0, s1) ^ n
    if n <= 16:
        if n >= 4:
            last, delta = n - 4, (n & 24) >> (n >> 3)
            a, b = (r32(0) << 32) | r32(last), (r32(delta) << 32) | r32(last - delta)
        elif n > 0:
            a, b = (data[0] << 56) | (data[n >> 1] << 32) | data[n - 1], 0
        else:
            a = b = 0
    else:
        at, left = 0, n
        if left > 48:
            see1 = see2 = seed
            while left >= 48:
                seed = _mix(r64(at) ^ s0, r64(at + 8) ^ seed)
                see1 = _mix(r64(at + 16) ^ s1, r64(at + 24) ^ see1)
                see2 = _mix(r64(at + 32) ^ s2, r64(at + 40) ^ see2)
                at, left = at + 48, left - 48
            seed ^= see1 ^ see2
        if left > 16:
            seed = _mix(r64(at) ^ s2, r64(at + 8) ^ seed ^ s1)
            if left > 32:
                seed = _mix(r64(at + 16) ^ s2, r64(at + 24) ^ seed)
        a, b = r64(at + left - 16), r64(at + left - 8)  # may reach back into bytes already mixed
    a, b = _mum(a ^ s1, b ^ seed)
    return _mix(a ^ s0 ^ n, b ^ s1)


LOG_HASHES = {5: murmur64a, 6: murmur64a, 7: rapidhash}  # per `# ninja log v<N>`
