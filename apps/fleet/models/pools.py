"""Node pools: a set of interchangeable nodes a job's gang is placed in."""

import re

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q

from apps.accounts.models import GPU_TYPES, slug_validator
from apps.fleet.models.catalogue import InstanceType
from apps.fleet.models.sites import Site


class PoolKind(models.TextChoices):
    OWNED = "owned", "Owned racks"
    CLOUD = "cloud", "Cloud"


class Fabric(models.TextChoices):
    """What a pool's nodes talk to each other over (apps/tuning/catalogue.py uses the values)."""

    INFINIBAND = "infiniband", "InfiniBand"
    ROCE = "roce", "RoCE"
    EFA = "efa", "AWS EFA"
    TCP = "tcp", "TCP sockets"


NCCL_VERSION_PATTERN = r"^\d+\.\d+(\.\d+)?$"


class OrphanPolicy(models.TextChoices):
    REPORT = "report", "Report them"
    TERMINATE = "terminate", "Terminate them"


# EC2's id formats: a prefix, then 8 or 17 hexadecimal digits (\Z: no trailing newline).
IMAGE_ID_PATTERN = r"\Aami-([0-9a-f]{8}|[0-9a-f]{17})\Z"
SUBNET_ID_PATTERN = r"\Asubnet-([0-9a-f]{8}|[0-9a-f]{17})\Z"
SECURITY_GROUP_PATTERN = re.compile(r"sg-([0-9a-f]{8}|[0-9a-f]{17})")
# A key pair's name (printable ASCII); an instance profile's name or ARN.
KEY_NAME_PATTERN = r"\A[ -~]{1,255}\Z"
INSTANCE_PROFILE_PATTERN = (
    r"\A([A-Za-z0-9_+=,.@-]{1,128}"
    r"|arn:aws[a-z-]*:iam::[0-9]{12}:instance-profile/[A-Za-z0-9_+=,.@/-]{1,512})\Z"
)


def validate_security_group_ids(value) -> None:
    """A list of up to 16 distinct security group ids (sg-...)."""
    if not isinstance(value, list) or len(value) > 16:
        raise ValidationError("A list of at most 16 security group ids.", code="invalid")
    for item in value:
        if not isinstance(item, str) or not SECURITY_GROUP_PATTERN.fullmatch(item):
            raise ValidationError(f"{item!r} is not a security group id (sg-…).", code="invalid")
    if len(set(value)) != len(value):
        raise ValidationError("Each security group once.", code="invalid")


# The pool fields only cloud pools have.
CLOUD_SETTINGS = ("image_id", "subnet_id", "security_group_ids", "key_name", "instance_profile")


class CapacityPreference(models.TextChoices):
    SPOT_THEN_ON_DEMAND = "spot_then_on_demand", "Spot, then on-demand"
    ON_DEMAND_ONLY = "on_demand_only", "On-demand only"


class Tenancy(models.TextChoices):
    """Whether jobs of different teams may share a node (jobs are untrusted code)."""

    TEAM = "team", "One team per node at a time"
    SHARED = "shared", "Teams may share a node; their jobs run as separate users"


class NodePool(models.Model):
    name = models.CharField(max_length=100, unique=True)
    slug = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    kind = models.CharField(max_length=10, choices=PoolKind.choices)
    gpu_type = models.CharField(max_length=10, choices=GPU_TYPES)
    site = models.ForeignKey(
        Site,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="pools",
        help_text="Owned pools: the data centre.",
    )
    region = models.CharField(max_length=30, blank=True, help_text="Cloud pools: e.g. us-east-1.")
    instance_types = models.ManyToManyField(InstanceType, blank=True, related_name="pools")
    capacity_preference = models.CharField(
        max_length=30,
        choices=CapacityPreference.choices,
        default=CapacityPreference.SPOT_THEN_ON_DEMAND,
    )
    min_nodes = models.PositiveIntegerField(default=0, validators=[MaxValueValidator(100000)])
    max_nodes = models.PositiveIntegerField(default=0, validators=[MaxValueValidator(100000)])
    burst_delay_s = models.PositiveIntegerField(
        default=600,
        validators=[MaxValueValidator(7 * 86400)],
        help_text="How long a job waits for owned capacity before this pool bursts for it.",
    )
    idle_timeout_s = models.PositiveIntegerField(
        default=900,
        validators=[MinValueValidator(60), MaxValueValidator(7 * 86400)],
        help_text="Cloud nodes idle this long are terminated.",
    )
    enabled = models.BooleanField(
        default=True, help_text="Cloud pools stay off until credentials are configured."
    )
    tenancy = models.CharField(
        max_length=10,
        choices=Tenancy.choices,
        default=Tenancy.TEAM,
        help_text="Shared: a node holds several teams' jobs only while its agent runs each "
        "job as its own user.",
    )
    # Nodes do not report their network: the pool says which NCCL settings fit.
    fabric = models.CharField(
        max_length=20,
        choices=Fabric.choices,
        blank=True,
        help_text="The inter-node network; picks the pool's default NCCL profile.",
    )
    nccl_version = models.CharField(
        max_length=20,
        blank=True,
        validators=[
            RegexValidator(NCCL_VERSION_PATTERN, "An NCCL version such as 2.21.5.", "invalid")
        ],
        help_text="The NCCL version on the pool's nodes, e.g. 2.21.5 (empty: unknown).",
    )
    spot_interruption_limit = models.FloatField(
        default=0.2,
        validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="Launch on-demand instead of spot while the share of this pool's spot "
        "nodes interrupted in the last 7 days is above this.",
    )
    orphans = models.CharField(
        max_length=10,
        choices=OrphanPolicy.choices,
        default=OrphanPolicy.REPORT,
        help_text="Instances with our tags that the database does not know.",
    )
    # Cloud pools: what the AWS provider launches burst nodes with.
    image_id = models.CharField(
        max_length=30,
        blank=True,
        validators=[RegexValidator(IMAGE_ID_PATTERN, "An AMI id such as ami-0a1b2c3d.", "invalid")],
        help_text="Cloud pools: the machine image (AMI) burst nodes boot; none, no bursts.",
    )
    subnet_id = models.CharField(
        max_length=40,
        blank=True,
        validators=[
            RegexValidator(SUBNET_ID_PATTERN, "A subnet id such as subnet-0a1b2c3d.", "invalid")
        ],
        help_text="Cloud pools: the subnet (and so the availability zone); empty: the default.",
    )
    security_group_ids = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_security_group_ids],
        help_text="Cloud pools: security group ids (sg-…); empty: the VPC's default group.",
    )
    key_name = models.CharField(
        max_length=255,
        blank=True,
        validators=[RegexValidator(KEY_NAME_PATTERN, "Printable ASCII, 255 at most.", "invalid")],
        help_text="Cloud pools: an EC2 key pair for SSH access to the instances (optional).",
    )
    instance_profile = models.CharField(
        max_length=600,
        blank=True,
        validators=[
            RegexValidator(
                INSTANCE_PROFILE_PATTERN, "An instance profile's name or ARN.", "invalid"
            )
        ],
        help_text="Cloud pools: the IAM instance profile (name or ARN) nodes run as, e.g. for "
        "checkpoints in S3.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_nodes__gte=F("min_nodes")), name="pool_max_at_least_min"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self):
        errors = {}
        if self.max_nodes < self.min_nodes:
            errors["max_nodes"] = "Must be at least min_nodes."
        if self.kind == PoolKind.CLOUD and not self.region:
            errors["region"] = "A cloud pool needs a region."
        if self.kind == PoolKind.OWNED and self.region:
            errors["region"] = "Owned pools have a site, not a region."
        if self.kind == PoolKind.OWNED:
            for name in CLOUD_SETTINGS:
                if getattr(self, name):
                    errors[name] = "Only cloud pools launch instances."
        if errors:
            raise ValidationError(errors)
