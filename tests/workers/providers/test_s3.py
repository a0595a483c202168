"""Checkpoint copies in S3 against a moto server: copied by the trainer's own upload, then
checked (read back, or by size) and deleted by workers/providers/s3.py. No database."""

import hashlib
import json

import pytest

from workers.providers.errors import ProviderError
from workers.providers.s3 import S3Store
from workers.trainer.checkpoint import copy_to_s3
from workers.trainer.config import S3Copy

boto3 = pytest.importorskip("boto3")


@pytest.fixture
def bucket(aws_endpoint, request):
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    name = f"ckpt-{abs(hash(request.node.name)) % 10**8}"
    client.create_bucket(Bucket=name)
    return client, name


def _copied(tmp_path, client, bucket, endpoint, step=4):
    checkpoint = tmp_path / f"step-{step:08d}"
    checkpoint.mkdir()
    files = {}
    for name, body in {"__0_0.distcp": b"shard" * 100, ".metadata": b"meta"}.items():
        (checkpoint / name).write_bytes(body)
        files[name] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    manifest = json.dumps({"format": 1, "step": step, "files": files}).encode()
    (checkpoint / "manifest.json").write_bytes(manifest)
    target = S3Copy(bucket=bucket, prefix="team/job-1", endpoint_url=endpoint, region="us-east-1")
    copy_to_s3(checkpoint, target, step)
    return f"s3://{bucket}/team/job-1/{checkpoint.name}", hashlib.sha256(manifest).hexdigest()


@pytest.mark.parametrize("mode", ["read", "size"])
def test_a_copy_the_trainer_made_verifies(tmp_path, bucket, aws_endpoint, mode):
    client, name = bucket
    uri, digest = _copied(tmp_path, client, name, aws_endpoint)
    store = S3Store(endpoint_url=aws_endpoint, region="us-east-1")
    assert store.verify(uri, digest, mode=mode).ok


def test_a_damaged_copy_is_named_by_its_first_bad_file(tmp_path, bucket, aws_endpoint):
    client, name = bucket
    uri, digest = _copied(tmp_path, client, name, aws_endpoint)
    store = S3Store(endpoint_url=aws_endpoint, region="us-east-1")
    client.put_object(Bucket=name, Key="team/job-1/step-00000004/__0_0.distcp", Body=b"x" * 500)
    read = store.verify(uri, digest, mode="read")
    assert not read.ok and "__0_0.distcp does not match" in read.problem
    assert store.verify(uri, digest, mode="size").ok  # same size: only a read tells
    client.delete_object(Bucket=name, Key="team/job-1/step-00000004/.metadata")
    assert ".metadata is missing" in store.verify(uri, digest, mode="size").problem
    assert "does not match the trainer" in store.verify(uri, "0" * 64).problem


def test_delete_removes_every_object_and_then_finds_nothing(tmp_path, bucket, aws_endpoint):
    client, name = bucket
    uri, digest = _copied(tmp_path, client, name, aws_endpoint)
    store = S3Store(endpoint_url=aws_endpoint, region="us-east-1")
    assert store.delete(uri) == 3
    assert client.list_objects_v2(Bucket=name).get("KeyCount") == 0
    assert store.delete(uri) == 0  # already gone: done, not an error
    verdict = store.verify(uri, digest)
    assert not verdict.ok and verdict.missing
    assert store.delete(f"s3://no-such-bucket-{name}/x/step-00000001") == 0


def test_an_unreachable_s3_is_a_retryable_error(monkeypatch):
    from botocore.config import Config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9",  # nothing listens there
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2),
    )
    store = S3Store(client=client)
    with pytest.raises(ProviderError) as raised:
        store.delete("s3://bucket/team/job-1/step-00000004")
    assert raised.value.retryable
