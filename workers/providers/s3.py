"""Checkpoint copies in S3, checked against their manifest and deleted (boto3, plain data in
and out, no Django: the checkpoints tasks call it and record what it says).

A copy is the prefix `s3://bucket/key/` holding one checkpoint's files, its manifest.json
uploaded last by the trainer (workers/trainer/checkpoint.py). Checking reads the manifest
and compares its SHA-256 with the one the trainer reported, then every file the manifest
lists: its SHA-256 read back ("read"), or only its size ("size", for copies too large to
read back often). Deleting removes every object under the prefix; nothing there is an
answer too (already gone), never an error.
"""

import hashlib
import json
from dataclasses import dataclass

from workers.providers.errors import ProviderError

MANIFEST = "manifest.json"
MODES = ("read", "size")
NOT_FOUND = ("NoSuchKey", "NoSuchBucket", "404")  # what get_object raises for no such object
THROTTLED = ("SlowDown", "RequestTimeout")


@dataclass(frozen=True)
class S3Verdict:
    ok: bool
    missing: bool = False
    problem: str = ""


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without its trailing slash) of an s3:// URI."""
    if not uri.startswith("s3://"):
        raise ProviderError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not bucket or not key.strip("/"):
        raise ProviderError(f"{uri!r} names no bucket and key")
    return bucket, key.strip("/")


def _transient(error: Exception) -> bool:
    """Worth trying again later: the network, throttling, S3's own errors."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(error, ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status == 429 or error.response["Error"].get("Code") in THROTTLED
    return isinstance(error, BotoCoreError | OSError)


def _code(error: Exception) -> str:
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class S3Store:
    def __init__(self, *, endpoint_url: str | None = None, region: str | None = None, client=None):
        if client is None:
            import boto3

            client = boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region)
        self.client = client

    def _failed(self, uri: str, error: Exception) -> ProviderError:
        return ProviderError(f"{uri}: {type(error).__name__}: {error}", retryable=_transient(error))

    def _open(self, bucket: str, key: str):
        """The object's body (a stream), or None and why it is not there."""
        try:
            return self.client.get_object(Bucket=bucket, Key=key)["Body"], ""
        except Exception as error:
            if _code(error) in NOT_FOUND:
                return None, _code(error)
            raise

    def _read(self, bucket: str, key: str) -> tuple[bytes | None, str]:
        """The object's bytes, or None and why it is not there."""
        body, why = self._open(bucket, key)
        if body is None:
            return None, why
        with body:
            return body.read(), ""

    def _sha256(self, bucket: str, key: str) -> str | None:
        body, _ = self._open(bucket, key)
        if body is None:
            return None
        digest = hashlib.sha256()
        with body:
            for chunk in iter(lambda: body.read(1 << 22), b""):
                digest.update(chunk)
        return digest.hexdigest()

    def _size(self, bucket: str, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except Exception as error:
            if _code(error) in (*NOT_FOUND, "NotFound"):  # head_object may say NotFound
                return None
            raise

    def verify(self, uri: str, manifest_sha256: str, *, mode: str = "read") -> S3Verdict:
        """Raises ProviderError when S3 could not answer (retryable: try again later)."""
        if mode not in MODES:
            raise ProviderError(f"mode must be one of {', '.join(MODES)}")
        bucket, key = split_uri(uri)
        try:
            body, why = self._read(bucket, f"{key}/{MANIFEST}")
            if body is None:
                missing = why == "NoSuchBucket" or not self._any(bucket, key)
                return S3Verdict(False, missing=missing, problem=f"{MANIFEST} is missing ({why})")
            if hashlib.sha256(body).hexdigest() != manifest_sha256:
                return S3Verdict(False, problem=f"{MANIFEST} does not match the trainer's SHA-256")
            try:
                files = sorted(json.loads(body)["files"].items())
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                return S3Verdict(False, problem=f"unreadable {MANIFEST}: {error}")
            for name, expected in files:
                object_key = f"{key}/{name}"
                if mode == "read":
                    digest = self._sha256(bucket, object_key)
                    if digest is None:
                        return S3Verdict(False, problem=f"{name} is missing")
                    if digest != expected.get("sha256"):
                        return S3Verdict(False, problem=f"{name} does not match its SHA-256")
                else:
                    size = self._size(bucket, object_key)
                    if size is None:
                        return S3Verdict(False, problem=f"{name} is missing")
                    if size != expected.get("size"):
                        return S3Verdict(
                            False, problem=f"{name} has {size} bytes, not {expected.get('size')}"
                        )
        except ProviderError:
            raise
        except Exception as error:
            raise self._failed(uri, error) from error
        return S3Verdict(True)

    def _any(self, bucket: str, key: str) -> bool:
        listed = self.client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/", MaxKeys=1)
        return bool(listed.get("KeyCount"))

    def delete(self, uri: str) -> int:
        """Delete every object of the copy; how many there were (0: already gone)."""
        bucket, key = split_uri(uri)
        deleted = 0
        try:
            while True:
                listed = self.client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/", MaxKeys=1000)
                keys = [{"Key": item["Key"]} for item in listed.get("Contents", [])]
                if not keys:
                    return deleted
                answer = self.client.delete_objects(
                    Bucket=bucket, Delete={"Objects": keys, "Quiet": True}
                )
                errors = answer.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise ProviderError(
                        f"{uri}: {len(errors)} object(s) not deleted, e.g. {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message')}",
                        retryable=True,
                    )
                deleted += len(keys)
        except ProviderError:
            raise
        except Exception as error:
            if _code(error) == "NoSuchBucket":
                return deleted
            raise self._failed(uri, error) from error
