"""`manage.py nccl_lint FILE`: a verdict per variable of an environment block; 1 on errors."""

import sys

from django.core.management.base import BaseCommand, CommandError

from apps.fleet.models import Fabric
from apps.tuning import catalogue, linter


class Command(BaseCommand):
    help = (
        "Lint the NCCL settings in FILE ('-' for stdin): export NAME=value, NAME=value or "
        'os.environ["NAME"] = "value" lines. Prints error, warning or ok per variable and '
        "exits 1 when any error is found (2 on bad usage)."
    )

    def add_arguments(self, parser):
        parser.add_argument("file")
        parser.add_argument("--fabric", choices=Fabric.values, default="")
        parser.add_argument("--nccl-version", default="", help="e.g. 2.21.5")
        parser.add_argument("--single-node", action="store_true")

    def handle(self, *args, **options):
        try:
            if options["file"] == "-":
                text = sys.stdin.read()
            else:
                with open(options["file"], encoding="utf-8", errors="replace") as handle:
                    text = handle.read()
        except OSError as exc:
            raise CommandError(
                f"cannot read {options['file']}: {exc.strerror}", returncode=2
            ) from None
        version = options["nccl_version"]
        try:
            catalogue.version_tuple(version)
        except ValueError:
            raise CommandError(f"not an NCCL version: {version}", returncode=2) from None
        context = linter.Context(
            fabric=options["fabric"], nccl_version=version, single_node=options["single_node"]
        )
        verdicts, parsed = linter.lint_text(text, context=context)
        for verdict in verdicts:
            self.stdout.write(linter.format_verdict(verdict))
        found = linter.counts(verdicts)
        self.stderr.write(
            f"{found['error']} error(s), {found['warning']} warning(s), {found['ok']} ok; "
            f"{parsed.ignored_lines} other line(s) skipped"
        )
        if found["error"]:
            sys.exit(1)
