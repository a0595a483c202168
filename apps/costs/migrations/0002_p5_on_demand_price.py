"""Seed the price book with the on-demand list price of p5.48xlarge in us-east-1.

An ordinary row: finance edits it (or adds a newer one) when AWS changes the price.
The figure and where it came from are in the row's `source`.
"""

import datetime as dt
from decimal import Decimal

from django.db import migrations

P5_PER_HOUR = Decimal("55.040000")
# AWS cut P5 On-Demand prices (up to 45%) from June 2025; the row starts then.
EFFECTIVE_FROM = dt.datetime(2025, 6, 1, tzinfo=dt.UTC)
SOURCE = (
    "AWS EC2 On-Demand list price, Linux, US East (N. Virginia): $55.04 per instance-hour "
    "($6.88 per GPU-hour), after AWS's June 2025 P5 price reduction (from $98.32). "
    "AWS's P5 page (https://aws.amazon.com/ec2/instance-types/p5/) as cited by public "
    "comparisons checked 2026-09-05 and 2026-06-30; looked up 2026-12-01. Check it against "
    "https://aws.amazon.com/ec2/pricing/on-demand/ before relying on it."
)


def seed(apps, schema_editor):
    InstanceType = apps.get_model("fleet", "InstanceType")
    CloudPrice = apps.get_model("costs", "CloudPrice")
    p5 = InstanceType.objects.filter(name="p5.48xlarge").first()
    if p5 is None:
        return
    CloudPrice.objects.get_or_create(
        instance_type=p5,
        region="us-east-1",
        effective_from=EFFECTIVE_FROM,
        defaults={"per_hour": P5_PER_HOUR, "source": SOURCE},
    )


def unseed(apps, schema_editor):
    CloudPrice = apps.get_model("costs", "CloudPrice")
    CloudPrice.objects.filter(
        instance_type__name="p5.48xlarge", region="us-east-1", effective_from=EFFECTIVE_FROM
    ).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("costs", "0001_initial"),
        ("fleet", "0002_instance_type_catalogue"),
    ]
    operations = [migrations.RunPython(seed, unseed)]
