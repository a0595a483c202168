"""Jobs, their history, allocations and runs, reservations, and the teams' decayed usage."""

from apps.jobs.models.datasets import Dataset
from apps.jobs.models.jobs import (
    Allocation,
    Job,
    JobEvent,
    JobKind,
    JobState,
    JobWait,
    Placement,
    PriorityClass,
)
from apps.jobs.models.reservations import Reservation
from apps.jobs.models.runs import (
    OPEN_RUN_STATES,
    EvalMetric,
    LogLine,
    NodeFault,
    RankEnvironment,
    Run,
    RunState,
    StepMetric,
)
from apps.jobs.models.usage import TeamUsage
from apps.jobs.models.webhooks import Webhook
