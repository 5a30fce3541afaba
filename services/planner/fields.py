"""The planner's field checks: every bad input value is a ``FieldError`` (a ValueError)
naming its field, relative to the object that checks it, or below an owner given by
``field_scope``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager


class FieldError(ValueError):
    """A bad input value. ``field`` is its path below ``owner`` (``weight``, ``throughput[16]``,
    ``current['n7']``); ``str()`` is ``"<owner>.<field>: <message>"``."""

    def __init__(self, owner: str, field: str, message: str) -> None:
        self.owner, self.field, self.message = owner, field, message
        super().__init__(f"{self.path}: {message}")

    @property
    def path(self) -> str:
        if not self.owner:
            return self.field
        return f"{self.owner}{'' if self.field.startswith('[') else '.'}{self.field}"

    def within(self, owner: str) -> FieldError:
        """The same error, named below ``owner`` instead (``request.jobs[2]``)."""
        return FieldError(owner, self.field, self.message)


@contextmanager
def field_scope(owner: str) -> Iterator[None]:
    """Renames a ``FieldError`` raised inside to sit below ``owner``::

    with field_scope(f"request.jobs[{i}]"):
        job = Job(...)          # a NaN weight raises "request.jobs[2].weight: ..."
    """
    try:
        yield
    except FieldError as exc:
        raise exc.within(owner) from None


def fail(where: str, name: str, message: str) -> None:
    raise FieldError(where, name, message)


def check_id(where: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        fail(where, name, f"must be a non-empty string, got {value!r}")


def check_int(where: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a slot count is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fail(where, name, f"must be an int >= {minimum}, got {value!r}")


def check_float(where: str, name: str, value: object, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 if positive else value >= 0):  # type: ignore[operator]
        return
    fail(where, name, f"must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def check_bool(where: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        fail(where, name, f"must be a bool, got {value!r}")
