"""SSH host keys as OpenSSH writes them ('type base64'), and their SHA256 fingerprints."""

import base64
import binascii
import hashlib
import struct

KEY_TYPES = {
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
}


class InvalidHostKey(ValueError):
    pass


def parse_host_key(text: str) -> tuple[str, bytes]:
    """Split 'ssh-ed25519 AAAA... [comment]' into its type and key blob, checking both."""
    parts = text.strip().split()
    if len(parts) < 2:
        raise InvalidHostKey("Expected 'TYPE BASE64', as in a known_hosts line without the host.")
    key_type, encoded = parts[0], parts[1]
    if key_type not in KEY_TYPES:
        raise InvalidHostKey(f"Unsupported key type {key_type!r}.")
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidHostKey("The key is not valid base64.") from None
    if len(blob) < 4:
        raise InvalidHostKey("The key is truncated.")
    (length,) = struct.unpack(">I", blob[:4])
    embedded = blob[4 : 4 + length].decode("ascii", "replace")
    if embedded != key_type:
        raise InvalidHostKey(f"The key says it is {embedded!r}, not {key_type!r}.")
    return key_type, blob


def fingerprint(blob: bytes) -> str:
    """OpenSSH's `SHA256:...` form, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(blob).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def host_key_fingerprint(text: str) -> str:
    return fingerprint(parse_host_key(text)[1])


def host_key_fingerprint_or_blank(text: str) -> str:
    """The fingerprint of a key, or "" for none or one that does not parse (shown, not checked)."""
    if not text:
        return ""
    try:
        return host_key_fingerprint(text)
    except InvalidHostKey:
        return ""
