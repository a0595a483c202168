"""Encryption of team secrets at rest (Fernet: AES-128-CBC with an HMAC-SHA256 tag).

Keys come from SECRETS_ENCRYPTION_KEYS (comma-separated Fernet keys, newest
first, so old keys still decrypt during a rotation); without it one key is
derived from SECRET_KEY with HKDF, which suits a laptop but ties the secrets to
that key.
"""

import base64
from functools import cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

MASK = "********"


@cache
def _cipher() -> MultiFernet:
    keys = [k.strip() for k in settings.SECRETS_ENCRYPTION_KEYS.split(",") if k.strip()]
    if not keys:
        derived = HKDF(
            algorithm=hashes.SHA256(),
            length=32,
            salt=b"controlplane-team-secrets",
            info=b"fernet",
        ).derive(settings.SECRET_KEY.encode())
        keys = [base64.urlsafe_b64encode(derived).decode()]
    return MultiFernet([Fernet(key) for key in keys])


def encrypt(value: str) -> bytes:
    return _cipher().encrypt(value.encode("utf-8"))


def decrypt(token: bytes) -> str:
    try:
        return _cipher().decrypt(bytes(token)).decode("utf-8")
    except InvalidToken:
        raise ValueError("This secret cannot be decrypted with the configured keys.") from None


def mask(text: str, values: list[str]) -> str:
    """Replace every secret value in `text` (a log line, an error) with a mask."""
    for value in sorted((v for v in values if len(v) >= 4), key=len, reverse=True):
        text = text.replace(value, MASK)
    return text
