"""What the node reports about itself: GPUs (from nvidia-smi, or CPU slots standing in) and disk.

One heartbeat reads `nvidia-smi` once. A node without it (the local provider,
CI) reports its CPU slots as GPUs with the machine's load as their utilisation,
so the whole path runs the same on a laptop.
"""

import os
import shutil
import subprocess

QUERY = (
    "index,uuid,name,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu,"
    "ecc.errors.uncorrected.volatile.total,driver_version"
)


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi(output: str) -> list[dict]:
    """Lines of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`."""
    gpus = []
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 10 or not cells[0].isdigit():
            continue
        util, used, total, power, temp, ecc = (_number(c) for c in cells[3:9])
        gpus.append(
            {
                "index": int(cells[0]),
                "uuid": cells[1],
                "name": cells[2],
                "utilization": util,
                "memory_used_mib": used,
                "memory_total_mib": total,
                "power_w": power,
                "temperature_c": temp,
                "ecc_errors": int(ecc) if ecc is not None else None,
                "driver_version": cells[9],
            }
        )
    return gpus


def gpu_metrics(*, slots: int) -> dict:
    """{"source": "nvidia-smi" | "cpu-slots" | "none", "gpus": [...], "message": ...}"""
    binary = shutil.which("nvidia-smi")
    if binary:
        try:
            output = subprocess.run(
                [binary, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
        except (subprocess.SubprocessError, OSError) as exc:
            return {"source": "nvidia-smi", "gpus": [], "message": f"nvidia-smi failed: {exc}"}
        return {"source": "nvidia-smi", "gpus": parse_nvidia_smi(output), "message": ""}
    if slots > 0:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        busy = min(100.0, 100.0 * load / max(os.cpu_count() or 1, 1))
        return {
            "source": "cpu-slots",
            "gpus": [
                {"index": i, "uuid": "", "name": "cpu-slot", "utilization": round(busy, 1)}
                for i in range(slots)
            ],
            "message": "no nvidia-smi: CPU slots stand in for GPUs",
        }
    return {"source": "none", "gpus": [], "message": "no nvidia-smi on this node"}


def nccl_version() -> str:
    """The NCCL that torch on this node was built with, if torch is installed; "" otherwise.

    Asked in a subprocess, so the agent itself never imports torch.
    """
    python = shutil.which("python3")
    if not python:
        return ""
    try:
        out = subprocess.run(
            [
                python,
                "-c",
                "import torch; v = torch.cuda.nccl.version() if torch.cuda.is_available() "
                "else None; print('.'.join(map(str, v)) if v else '')",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return ""
    return out if out.replace(".", "").isdigit() else ""


def disk_free_bytes(path) -> int:
    return shutil.disk_usage(path).free
