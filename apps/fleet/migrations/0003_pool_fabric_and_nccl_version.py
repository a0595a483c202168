"""Pools record their fabric and NCCL version until nodes report theirs.

Existing cloud pools that burst to EFA instance types (p4d, p5...) are marked EFA.
"""

import django.core.validators
from django.db import migrations, models

EFA_INSTANCE_PREFIXES = ("p4d.", "p4de.", "p5.", "p5e.", "p5en.")


def mark_efa_pools(apps, schema_editor):
    NodePool = apps.get_model("fleet", "NodePool")
    for pool in NodePool.objects.filter(kind="cloud", fabric="").prefetch_related("instance_types"):
        if any(t.name.startswith(EFA_INSTANCE_PREFIXES) for t in pool.instance_types.all()):
            pool.fabric = "efa"
            pool.save(update_fields=["fabric"])


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0002_instance_type_catalogue"),
    ]

    operations = [
        migrations.AddField(
            model_name="nodepool",
            name="fabric",
            field=models.CharField(
                blank=True,
                choices=[
                    ("infiniband", "InfiniBand"),
                    ("roce", "RoCE"),
                    ("efa", "AWS EFA"),
                    ("tcp", "TCP sockets"),
                ],
                help_text="The inter-node network; picks the pool's default NCCL profile.",
                max_length=20,
            ),
        ),
        migrations.AddField(
            model_name="nodepool",
            name="nccl_version",
            field=models.CharField(
                blank=True,
                help_text="The NCCL version on the pool's nodes, e.g. 2.21.5 (empty: unknown).",
                max_length=20,
                validators=[
                    django.core.validators.RegexValidator(
                        "^\\d+\\.\\d+(\\.\\d+)?$", "An NCCL version such as 2.21.5.", "invalid"
                    )
                ],
            ),
        ),
        migrations.RunPython(mark_efa_pools, migrations.RunPython.noop),
    ]
