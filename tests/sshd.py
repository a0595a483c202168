"""A real OpenSSH sshd on 127.0.0.1 for the SSH provider's tests and the end-to-end ones
(a pytest plugin, named in tests/conftest.py). The moto server is in
tests/workers/conftest.py, shared with the cloud tasks' tests.
"""

import shutil
from pathlib import Path

import pytest

from tests.workers.providers.servers import SSHD, SshServer, keygen


def _sshd_usable() -> str:
    """Why sshd cannot run here, or '' when it can."""
    if not SSHD.exists():
        return "needs /usr/sbin/sshd (apt-get install -y openssh-server; make test installs it)"
    if shutil.which("ssh-keygen") is None:
        return "needs ssh-keygen (openssh-client)"
    try:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    except PermissionError:
        if not Path("/run/sshd").is_dir():
            return "sshd needs /run/sshd, which only root can create"
    return ""


@pytest.fixture(scope="session")
def client_key(tmp_path_factory) -> Path:
    return keygen(tmp_path_factory.mktemp("client") / "id_ed25519")


@pytest.fixture(scope="session")
def ssh_server_factory(tmp_path_factory, client_key):
    """Start extra sshd servers (each with its own port and host key); stopped at the end."""
    reason = _sshd_usable()
    if reason:
        pytest.skip(reason)
    servers = []

    def start() -> SshServer:
        server = SshServer(directory=tmp_path_factory.mktemp("sshd"), client_key=client_key)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def ssh_server(ssh_server_factory) -> SshServer:
    """The sshd most tests share."""
    return ssh_server_factory()
