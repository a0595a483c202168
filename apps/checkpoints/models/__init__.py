"""Checkpoints: the registry of checkpoints and their copies, sweeps, exports, and S3
destinations."""

from apps.checkpoints.models.checkpoints import (
    LIVE_STATES,
    ON_STORAGE_COPY_STATES,
    PRESENT_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    CheckpointState,
    CopyKind,
    CopyRequest,
    CopyState,
    StorageSweep,
)
from apps.checkpoints.models.destinations import S3Destination
from apps.checkpoints.models.exports import CheckpointExport, ExportDtype, ExportState
