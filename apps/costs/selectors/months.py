"""The month and day boundaries spend is counted by, in the costs time zone."""

import datetime as dt
import logging
import zoneinfo

from django.conf import settings
from django.utils import timezone

from apps.fleet.models.nodes import CapacityType

log = logging.getLogger(__name__)

CAPACITY_LABELS = dict(CapacityType.choices)
IDLE_LABEL = "idle"


def time_zone() -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(settings.COSTS_TIME_ZONE)


def local_today(now: dt.datetime | None = None) -> dt.date:
    return (now or timezone.now()).astimezone(time_zone()).date()


def month_start(now: dt.datetime | None = None) -> dt.date:
    return local_today(now).replace(day=1)


def month_after(first: dt.date) -> dt.date:
    return (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1)


def local_midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(0), tzinfo=time_zone())
