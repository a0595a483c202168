"""Print which database and broker the suite will use (called by `make test`)."""

import os


def describe() -> str:
    database = os.environ.get("DATABASE_URL", "")
    redis = os.environ.get("REDIS_URL", "")
    parts = []
    if database.startswith(("postgres", "pgsql")):
        parts.append(f"PostgreSQL ({_without_password(database)})")
    else:
        parts.append("SQLite in memory (tests marked 'postgres' are skipped: DATABASE_URL unset)")
    if redis:
        parts.append(f"Redis broker and cache ({_without_password(redis)})")
    else:
        parts.append(
            "filesystem broker and database cache (tests marked 'redis' are skipped: "
            "REDIS_URL unset)"
        )
    return "tests run against: " + "; ".join(parts)


def _without_password(url: str) -> str:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url


if __name__ == "__main__":
    print(describe())
