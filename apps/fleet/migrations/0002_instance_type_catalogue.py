"""Load the published hardware facts of the AWS GPU instance types we burst to.

Sources: AWS's instance-type pages for P5 (https://aws.amazon.com/ec2/instance-types/p5/)
and P4 (https://aws.amazon.com/ec2/instance-types/p4/). Editable afterwards.
"""

from decimal import Decimal

from django.db import migrations

P5 = "https://aws.amazon.com/ec2/instance-types/p5/"
P4 = "https://aws.amazon.com/ec2/instance-types/p4/"

CATALOGUE = [
    # name, GPU, count, GiB per GPU, vCPUs, memory GiB, EFA Gbps, NVMe TB, source
    ("p5.48xlarge", "H100", 8, 80, 192, 2048, 3200, Decimal("30.72"), P5),
    ("p5e.48xlarge", "H200", 8, 141, 192, 2048, 3200, Decimal("30.72"), P5),
    ("p5en.48xlarge", "H200", 8, 141, 192, 2048, 3200, Decimal("30.72"), P5),
    ("p4d.24xlarge", "A100", 8, 40, 96, 1152, 400, Decimal("8.00"), P4),
]


def load(apps, schema_editor):
    InstanceType = apps.get_model("fleet", "InstanceType")
    for name, gpu, count, gib, vcpus, memory, gbps, nvme, source in CATALOGUE:
        InstanceType.objects.update_or_create(
            name=name,
            defaults={
                "gpu_type": gpu,
                "gpu_count": count,
                "gpu_memory_gib": gib,
                "vcpus": vcpus,
                "memory_gib": memory,
                "network_gbps": gbps,
                "local_nvme_tb": nvme,
                "source": source,
            },
        )


def unload(apps, schema_editor):
    InstanceType = apps.get_model("fleet", "InstanceType")
    InstanceType.objects.filter(name__in=[row[0] for row in CATALOGUE], nodes=None).delete()


class Migration(migrations.Migration):
    dependencies = [("fleet", "0001_initial")]
    operations = [migrations.RunPython(load, unload)]
