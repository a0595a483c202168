"""Every write to the checkpoint registry, by concern."""

from apps.checkpoints.services.agent_input import invalid_input
from apps.checkpoints.services.exports import (
    checkpoint_export_allowed,
    checkpoint_export_request,
    export_record,
    exports_expire,
)
from apps.checkpoints.services.gc import (
    checkpoint_delete,
    checkpoints_collect,
    copy_delete,
    copy_deletion_record,
    requests_reoffer,
    retention_apply,
    sweep_record,
    sweep_request,
)
from apps.checkpoints.services.ownership import (
    agent_work_vet,
    copies_vet,
    s3_copy_settings,
    s3_destination_create,
    s3_destination_delete,
    s3_destination_update,
)
from apps.checkpoints.services.reports import checkpoint_event_record
from apps.checkpoints.services.resume import checkpoint_resume_prepare
from apps.checkpoints.services.verification import (
    checkpoint_verify_request,
    copy_request_retry,
    copy_verification_record,
)
