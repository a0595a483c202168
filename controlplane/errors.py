"""The one error type services raise; the API renders it as one JSON shape."""


class ApplicationError(Exception):
    """A rule said no. `code` is stable for scripts, `message` is for people.

    Rendered as `{"error": {"code": ..., "message": ..., "details": {...}}}` with
    `status` as the HTTP status (400 unless the rule says otherwise, e.g. 409
    for a state transition that is not allowed from the current state).
    """

    def __init__(self, message: str, *, code: str = "invalid", details=None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.code = code
        self.details = details or {}
        self.status = status

    def __str__(self) -> str:
        return self.message
