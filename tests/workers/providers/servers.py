"""The OpenSSH server the SSH provider tests run against, and the keys they use."""

import getpass
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
# The remote side's PATH starts with this server's fakebin folder, empty unless
# a test puts a stand-in program there (the fake nvidia-smi).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# CI has no GPUs: this stands in for nvidia-smi on the "owned node" (the sshd on 127.0.0.1),
# answering both the provider's detection query and the agent's metrics query for 4 H100s.
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=index,uuid,name,memory.total,driver_version)
    for i in 0 1 2 3; do
      echo "$i, GPU-0000000$i-e2e, NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15"
    done ;;
  *)
    for i in 0 1 2 3; do
      echo "$i, GPU-0000000$i-e2e, NVIDIA H100 80GB HBM3, 35, 1200, 81559, 310.5, 41, 0, 550.54.15"
    done ;;
esac
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def keygen(path: Path, key_type: str = "ed25519") -> Path:
    """A new key pair (path and path.pub), made by OpenSSH's own ssh-keygen."""
    path.unlink(missing_ok=True)
    Path(f"{path}.pub").unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", key_type, "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
    )
    return path


def public_key(path: Path) -> str:
    """'type base64' from a .pub file: what the control plane pins."""
    key_type, blob, *_ = Path(f"{path}.pub").read_text().split()
    return f"{key_type} {blob}"


def ssh_keygen_fingerprint(path: Path) -> str:
    """The SHA256 fingerprint as `ssh-keygen -lf` prints it."""
    out = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", f"{path}.pub"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.split()[1]


@dataclass
class SshServer:
    """One sshd -D on 127.0.0.1 with its own config, host key and authorized_keys."""

    directory: Path
    client_key: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def host_key(self) -> Path:
        return self.directory / "host_key"

    @property
    def fakebin(self) -> Path:
        return self.directory / "fakebin"

    @property
    def user(self) -> str:
        return getpass.getuser()

    def start(self) -> None:
        self.fakebin.mkdir(exist_ok=True)
        if not self.host_key.exists():
            keygen(self.host_key)
        authorized = self.directory / "authorized_keys"
        authorized.write_text(Path(f"{self.client_key}.pub").read_text())
        authorized.chmod(0o600)
        config = self.directory / "sshd_config"
        config.write_text(
            f"Port {self.port}\n"
            "ListenAddress 127.0.0.1\n"
            f"HostKey {self.host_key}\n"
            f"PidFile {self.directory / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {authorized}\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            # Tests run as root here; the key is the only way in.
            "PermitRootLogin yes\n"
            "UsePAM no\n"
            # The temporary directory sits under a world-writable /tmp.
            "StrictModes no\n"
            "Subsystem sftp internal-sftp\n"
            f"SetEnv PATH={self.fakebin}:{SYSTEM_PATH}\n"
            "MaxStartups 50\n"
            "LogLevel ERROR\n"
        )
        log = open(self.directory / "sshd.log", "ab")  # noqa: SIM115 (sshd keeps writing to it)
        self.process = subprocess.Popen(
            [str(SSHD), "-f", str(config), "-D", "-e"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.directory / 'sshd.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    if conn.recv(64).startswith(b"SSH-2.0-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not answer within 10 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
