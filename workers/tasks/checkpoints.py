"""Checkpoints: S3 copies checked and deleted with boto3, and GC's pass.

checkpoints.verify_s3   soon after an S3 copy is reported, and every CHECKPOINT_GC_EVERY_S:
                        each S3 copy asked for is checked against its manifest
checkpoints.collect     every CHECKPOINT_GC_EVERY_S: retention marks what it no longer
                        keeps (storage first: agents delete directories, this task deletes
                        S3 objects, rows follow their answers), failed deletions are tried
                        again, unanswered requests re-asked, ended jobs' directories swept
"""

import logging

from celery import shared_task
from django.conf import settings

from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)


def s3_store():
    from workers.providers.s3 import S3Store

    return S3Store(endpoint_url=settings.AWS_ENDPOINT_URL or None, region=settings.AWS_REGION)


def s3_copies_verify(*, store=None) -> dict[str, int]:
    """Check the S3 copies asked for; record each verdict (or try again later). A copy whose
    URI is not under its own job's prefix is never read (copies_vet)."""
    from apps.checkpoints.selectors import s3_verifications_due
    from apps.checkpoints.services import copies_vet, copy_request_retry, copy_verification_record
    from workers.providers.errors import ProviderError

    store = store or s3_store()
    due = s3_verifications_due()
    vetted = copies_vet(copy_ids=[work.copy_id for work in due])
    counts = {"verified": 0, "corrupt": 0, "later": 0, "refused": len(due) - len(vetted)}
    for work in (w for w in due if w.copy_id in vetted):
        try:
            verdict = store.verify(
                work.uri, work.manifest_sha256, mode=settings.CHECKPOINT_S3_VERIFY
            )
        except ProviderError as exc:
            if exc.retryable:
                copy_request_retry(copy_id=work.copy_id, message=str(exc))
                counts["later"] += 1
            else:
                copy_verification_record(copy_id=work.copy_id, ok=False, problem=str(exc))
                counts["corrupt"] += 1
            continue
        copy_verification_record(
            copy_id=work.copy_id,
            ok=verdict.ok,
            missing=verdict.missing,
            problem=verdict.problem,
        )
        counts["verified" if verdict.ok else "corrupt"] += 1
    return counts


def s3_copies_delete(*, store=None) -> dict[str, int]:
    """Delete the S3 copies GC marked; a copy is marked deleted only once S3 says so. A copy
    whose URI is not under its own job's prefix is never deleted (copies_vet)."""
    from apps.checkpoints.selectors import s3_deletions_due
    from apps.checkpoints.services import copies_vet, copy_deletion_record
    from workers.providers.errors import ProviderError

    store = store or s3_store()
    due = s3_deletions_due()
    vetted = copies_vet(copy_ids=[work.copy_id for work in due])
    counts = {"deleted": 0, "gone": 0, "failed": 0, "refused": len(due) - len(vetted)}
    for work in (w for w in due if w.copy_id in vetted):
        try:
            removed = store.delete(work.uri)
        except ProviderError as exc:
            copy_deletion_record(copy_id=work.copy_id, outcome="failed", message=str(exc))
            counts["failed"] += 1
            continue
        outcome = "deleted" if removed else "gone"
        copy_deletion_record(copy_id=work.copy_id, outcome=outcome)
        counts[outcome] += 1
    return counts


def collect_run(*, store=None) -> dict:
    from apps.checkpoints.services import checkpoints_collect

    return {**checkpoints_collect(), **s3_copies_delete(store=store)}


@shared_task(name="checkpoints.verify_s3", acks_late=True, reject_on_worker_lost=True)
def verify_s3() -> dict:
    from apps.accounts.context import Origin, acting_from

    with single_flight("checkpoints.verify_s3", ttl_s=900) as got_it:
        if not got_it:
            return {"skipped": "another check is going"}
        with acting_from(Origin(channel="task", label="task:checkpoints.verify_s3")):
            return s3_copies_verify()


@shared_task(name="checkpoints.collect", acks_late=True, reject_on_worker_lost=True)
def collect() -> dict:
    from apps.accounts.context import Origin, acting_from

    with single_flight("checkpoints.collect", ttl_s=900) as got_it:
        if not got_it:
            return {"skipped": "another pass is going"}
        with acting_from(Origin(channel="task", label="task:checkpoints.collect")):
            result = collect_run()
    if any(result.values()):
        log.info("checkpoints GC: %s", result)
    return result
