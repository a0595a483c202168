"""Which of a job's checkpoints retention keeps: a pure function over plain data.

Kept: the newest `keep_last` usable checkpoints, every checkpoint whose step is a multiple
of `keep_every`, the final one (the step the job was asked to reach), the one a run plan
last named to resume from (while the job is active), and everything at or after the
newest *secured* checkpoint: verified, and when its run copies to S3, with a verified S3
copy. Nothing is deleted until some checkpoint is secured, so an older checkpoint is only
ever deleted after a newer one exists twice and was checked (write two copies, verify,
then delete the old). A commit of a step saved again supersedes the older commit of
that step; corrupt checkpoints before the secured one are deleted.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    keep_last: int = 3
    keep_every: int | None = None
    final_step: int | None = None


def policy_for(trainer: dict, *, default_keep_last: int) -> Policy:
    """The policy a job's trainer spec asks for (checkpoint_keep, checkpoint_keep_every, steps)."""
    return Policy(
        keep_last=trainer.get("checkpoint_keep") or default_keep_last,
        keep_every=trainer.get("checkpoint_keep_every"),
        final_step=trainer.get("steps"),
    )


@dataclass(frozen=True)
class Held:
    """One live checkpoint: usable (committed or verified) or corrupt."""

    id: int
    step: int
    order: float  # when it was committed: breaks ties between commits of one step
    usable: bool
    secured: bool
    pinned: bool = False


def to_delete(checkpoints: list[Held], policy: Policy) -> dict[int, str]:
    """The ids to delete, each with why (for the registry's record)."""
    newest_first = sorted(checkpoints, key=lambda c: (c.step, c.order), reverse=True)
    secured = next((c for c in newest_first if c.usable and c.secured), None)
    if secured is None:
        return {}
    # The newest commit of each step is the one that counts.
    seen_steps: set[int] = set()
    current, superseded = [], []
    for held in newest_first:
        if held.usable and held.step not in seen_steps:
            seen_steps.add(held.step)
            current.append(held)
        elif held.usable:
            superseded.append(held)
    keep = {c.id for c in current[: max(policy.keep_last, 1)]}
    if policy.keep_every:
        keep |= {c.id for c in current if c.step % policy.keep_every == 0}
    if policy.final_step is not None:
        keep |= {c.id for c in current if c.step == policy.final_step}
    keep |= {c.id for c in checkpoints if c.pinned}
    keep.add(secured.id)
    after = (secured.step, secured.order)
    reasons = {}
    for held in newest_first:
        if held.id in keep or (held.step, held.order) >= after:
            continue
        if not held.usable:
            reasons[held.id] = "corrupt, and a newer checkpoint is secured"
        elif held in superseded:
            reasons[held.id] = f"step {held.step} was saved again since"
        else:
            reasons[held.id] = (
                f"retention: keeps the newest {policy.keep_last}"
                + (f", every {policy.keep_every}th step" if policy.keep_every else "")
                + " and the final one"
            )
    return reasons
