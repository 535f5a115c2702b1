"""Ed25519 signatures over manifests: whoever can write the store must not run code in every pod.

    NAME.key   kcache-ed25519-private NAME <base64 seed>   (mode 0600; KCACHE_SIGNING_KEY)
    NAME.pub   kcache-ed25519 NAME <base64 public key>     (KCACHE_TRUSTED_KEYS, ':'-separated)
    store:     signatures/<manifest-id>/<NAME>              one object per signing key

A signature covers canonical JSON of {bundle key, manifest id, manifest size}, so a valid manifest
cannot be replayed under another bundle key, and restore can check it knowing only the manifest's
size in the store: the manifest is fetched (at most that many bytes) only once a trusted key
vouched for it. Refs are signed by the same keys (their signatures live inside the ref, see refs.py).
Keys are named so they can be rotated: a pod trusts a set of public keys and accepts a bundle
signed by any of them.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kcache import atomic, boundedread, canonical, limits
from kcache.errors import ConfigError, SignatureError
from kcache.store import Store

PRIVATE_TAG = "kcache-ed25519-private"
PUBLIC_TAG = "kcache-ed25519"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


@dataclass(frozen=True)
class SigningKey:
    name: str
    seed: bytes  # the 32-byte Ed25519 private seed


@dataclass(frozen=True)
class TrustedKey:
    name: str
    public: bytes  # the 32-byte Ed25519 public key


# A key file is one line of about 60 characters.
MAX_KEY_FILE_BYTES = 4096


def signature_key(manifest_id: str, key_name: str) -> str:
    return f"signatures/{manifest_id}/{key_name}"


def message(bundle_key: str, manifest_id: str, manifest_size: int) -> bytes:
    return canonical.dumps({"schema": 1, "bundle_key": bundle_key, "manifest": manifest_id, "size": manifest_size})


def generate(name: str, directory: Path) -> tuple[Path, Path]:
    """Write NAME.key (0600) and NAME.pub into `directory`; refuse to overwrite either."""

    if not _NAME.match(name):
        raise ConfigError("key name", name, "use letters, digits, '.', '-' and '_'")
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    for path in (private, public):
        if path.exists():
            raise _exists(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_pair(name, private, public)
    except OSError as exc:
        raise ConfigError("key directory", str(directory), f"cannot write there: {exc.strerror or exc}") from None
    return private, public


def _write_pair(name: str, private: Path, public: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    pub = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    # The private key is never readable by others, not even while it is written (the temp file is 0600).
    if not atomic.write_text(private, f"{PRIVATE_TAG} {name} {base64.b64encode(seed).decode()}\n", mode=0o600,
                             overwrite=False):  # fmt: skip
        raise _exists(private)
    if not atomic.write_text(public, f"{PUBLIC_TAG} {name} {base64.b64encode(pub).decode()}\n", overwrite=False):
        raise _exists(public)


def _exists(path: Path) -> ConfigError:
    return ConfigError("key file", str(path), "exists already; pick another name or move it away")


def _read_key_file(path: Path, tag: str) -> tuple[str, bytes]:
    data = boundedread.read_named(Path(path), MAX_KEY_FILE_BYTES, "key file")
    try:
        words = data.decode("ascii").split()
        if len(words) != 3 or words[0] != tag or not _NAME.match(words[1]):
            raise ValueError
        raw = base64.b64decode(words[2], validate=True)
        if len(raw) != 32:
            raise ValueError
    except (ValueError, binascii.Error):  # UnicodeDecodeError is a ValueError
        raise ConfigError("key file", str(path), f"is not a '{tag} NAME BASE64' key (see `kcache keygen`)") from None
    return words[1], raw


def load_signing_key(path: Path) -> SigningKey:
    return SigningKey(*_read_key_file(path, PRIVATE_TAG))


def load_trusted_keys(paths) -> tuple[TrustedKey, ...]:
    return tuple(TrustedKey(*_read_key_file(Path(p), PUBLIC_TAG)) for p in paths)


def public_of(key: SigningKey) -> TrustedKey:
    """The public half of `key`, under its name: what checks this key's own signatures."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = Ed25519PrivateKey.from_private_bytes(key.seed).public_key()
    return TrustedKey(key.name, public.public_bytes(Encoding.Raw, PublicFormat.Raw))


def sign(store: Store, key: SigningKey, bundle_key: str, manifest_id: str, manifest_size: int) -> bool:
    """Store this key's signature of the manifest, replacing any other bytes stored under its name.
    True if this call wrote it."""
    # Ed25519 signs the same bytes the same way: another signature under this name is planted or damaged.
    signature = sign_message(key, message(bundle_key, manifest_id, manifest_size)).encode()
    return limits.put_exactly(store, signature_key(manifest_id, key.name), signature, "signature")


def sign_message(key: SigningKey, signed: bytes) -> str:
    """The base64 Ed25519 signature of `signed` (deterministic: the same bytes sign the same)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return base64.b64encode(Ed25519PrivateKey.from_private_bytes(key.seed).sign(signed)).decode()


def verify(store: Store, trusted: tuple[TrustedKey, ...], bundle_key: str, manifest_id: str, size: int) -> str | None:
    """The name of a trusted key that signed this manifest, or None if none of them signed it.

    Needs only the manifest's size, not its bytes: restore checks the signature before it
    downloads the manifest. A signature that is present but does not verify is an attack or
    corruption: SignatureError.
    """
    found = {}
    for key in trusted:
        raw = limits.read_capped(store, signature_key(manifest_id, key.name), limits.SIGNATURE_BYTES, "signature")
        if raw is not None:
            found[key.name] = raw.decode("ascii", "replace")
    return check(trusted, found, message(bundle_key, manifest_id, size), manifest_id)


def check(trusted: tuple[TrustedKey, ...], signatures: Mapping[str, str], signed: bytes, what: str) -> str | None:
    """The first trusted key whose signature in `signatures` ({key name: base64}) verifies `signed`.

    None when no trusted key signed; SignatureError when a trusted key's signature is there but
    does not verify (forged, or signed for other bytes).
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    problems = []
    for key in trusted:
        if key.name not in signatures:
            continue
        try:
            raw = base64.b64decode(signatures[key.name], validate=True)
            Ed25519PublicKey.from_public_bytes(key.public).verify(raw, signed)
            return key.name
        except (InvalidSignature, ValueError, binascii.Error):
            problems.append(f"the signature by {key.name!r} does not verify")
    if problems:
        raise SignatureError(what, "; ".join(problems))
    return None
