"""Parts of a job's detail that apps above jobs provide, without jobs importing them.

An app registers a provider when it is ready (AppConfig.ready), and the API's jobs/{id}/
asks it for its part: checkpoints sit above jobs (README, "Design"), so this is how a
job's detail shows its checkpoints. A part nobody provides is null.
"""

from collections.abc import Callable

_providers: dict[str, Callable] = {}


def job_detail_part_register(name: str, provider: Callable) -> None:
    _providers[name] = provider


def job_detail_part(name: str, job):
    provider = _providers.get(name)
    return provider(job) if provider is not None else None
