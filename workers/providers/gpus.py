"""GPU detection on a node: the nvidia-smi query and how its output is read."""

import csv
import io

from workers.providers.interface import Gpu, GpuReport

NVIDIA_SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=index,uuid,name,memory.total,driver_version",
    "--format=csv,noheader",
)
COMMAND_NOT_FOUND = 127  # what a POSIX shell returns for a program not on PATH


def parse_gpus(text: str) -> tuple[Gpu, ...]:
    """Lines like `0, GPU-5c2e..., NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15`."""
    gpus = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not row or not "".join(row).strip():
            continue
        if len(row) != 5:
            raise ValueError(f"expected 5 fields, got {len(row)}: {row!r}")
        index, gpu_uuid, name, memory, driver = (field.strip() for field in row)
        gpus.append(
            Gpu(
                index=int(index),
                uuid=gpu_uuid,
                name=name,
                memory_mib=_mebibytes(memory),
                driver_version=driver,
            )
        )
    return tuple(gpus)


def _mebibytes(value: str) -> int | None:
    number, _, unit = value.partition(" ")
    if not number.isdigit():
        return None  # "[N/A]" on some boards
    if unit in ("", "MiB"):
        return int(number)
    if unit == "GiB":
        return int(number) * 1024
    return None


def gpu_report(exit_status: int, stdout: str, stderr: str) -> GpuReport:
    """Turn one run of NVIDIA_SMI_QUERY into a report; never raises on a bad node."""
    if exit_status == COMMAND_NOT_FOUND:
        return GpuReport(
            found=False, message="nvidia-smi is not on the node's PATH: no GPUs found."
        )
    if exit_status != 0:
        detail = (stderr or stdout).strip()[-300:]
        return GpuReport(
            found=False, message=f"nvidia-smi failed with status {exit_status}: {detail}"
        )
    try:
        gpus = parse_gpus(stdout)
    except ValueError as error:
        return GpuReport(found=False, message=f"nvidia-smi printed what we cannot read: {error}")
    if not gpus:
        return GpuReport(found=False, message="nvidia-smi listed no GPUs.")
    return GpuReport(found=True, gpus=gpus, message=f"{len(gpus)} GPUs: {gpus[0].name}.")
