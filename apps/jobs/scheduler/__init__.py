"""The scheduler: `plan(snapshot) -> decisions` is pure; reading and applying are separate."""
