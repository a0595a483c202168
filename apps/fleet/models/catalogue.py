"""Cloud instance types and their published hardware facts."""

import re
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, URLValidator
from django.db import models

from apps.accounts.models import GPU_TYPES

# What may follow the host in an RFC 3986 URI: path, query and one fragment, each made of
# unreserved characters, sub-delimiters, ":" "@" "/" "?" and %-escapes. Django's URLValidator
# lets through more (any non-space character), which the API's `format: uri` does not.
_AFTER_HOST = re.compile(
    r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*"
    r"(?:#(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*)?"
)
_is_http_url = URLValidator(schemes=["http", "https"])


def validate_http_url(value: str) -> None:
    """An absolute http(s) URL in plain ASCII, without credentials (RFC 3986)."""
    _is_http_url(value)
    parts = urlsplit(value)
    after_host = value[len(f"{parts.scheme}://{parts.netloc}") :]
    if not value.isascii() or "@" in parts.netloc or not _AFTER_HOST.fullmatch(after_host):
        raise ValidationError(
            "Enter an http(s) URL in ASCII, without a user name (%-escape other characters).",
            code="invalid",
        )


class InstanceType(models.Model):
    name = models.CharField(max_length=50, unique=True)
    gpu_type = models.CharField(max_length=10, choices=GPU_TYPES)
    gpu_count = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    gpu_memory_gib = models.PositiveIntegerField(help_text="Per GPU.")
    vcpus = models.PositiveIntegerField()
    memory_gib = models.PositiveIntegerField()
    network_gbps = models.PositiveIntegerField(help_text="EFA bandwidth per instance.")
    local_nvme_tb = models.DecimalField(max_digits=6, decimal_places=2, default=0)
    source = models.URLField(
        blank=True, validators=[validate_http_url], help_text="Where the facts were published."
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
