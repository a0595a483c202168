"""`cpctl`, the command-line client: standard library only, apart from the Django project."""
