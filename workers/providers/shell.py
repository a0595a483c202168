"""The one way a command line for a remote shell is made: an argument list, each quoted.

SSH runs a command as one string through the login shell, and EC2 user data is
a shell script. Both are built here from argument lists with `shlex.quote`, so
text from users (a path, a token, `; rm -rf /`) always arrives as one literal
argument and never as shell syntax.
"""

import shlex
from collections.abc import Sequence

from workers.providers.errors import ConfigurationError


def quote_argv(argv: Sequence[str]) -> str:
    if isinstance(argv, str | bytes):
        raise ConfigurationError("A command is an argument list, not a string.")
    if not argv:
        raise ConfigurationError("A command needs at least one argument.")
    for arg in argv:
        if not isinstance(arg, str):
            raise ConfigurationError(f"Command arguments are strings, not {type(arg).__name__}.")
        if "\0" in arg:
            raise ConfigurationError("A command argument cannot contain a NUL character.")
    return " ".join(shlex.quote(arg) for arg in argv)
