"""A moto server on 127.0.0.1, shared by the AWS provider's tests and the cloud tasks' tests."""

import pytest

from tests.workers.providers.servers import free_port


@pytest.fixture(scope="session")
def moto_endpoint():
    """A moto server on 127.0.0.1 for the whole session."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def aws_endpoint(moto_endpoint, monkeypatch):
    """The moto server, with dummy credentials in the environment for boto3."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return moto_endpoint
