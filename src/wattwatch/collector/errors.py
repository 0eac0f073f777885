"""The one exception routes raise to answer with an error; app.py turns it into JSON."""

from __future__ import annotations


class ApiError(Exception):
    """Answer ``status`` with ``{"error": message, "field": field}``."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
