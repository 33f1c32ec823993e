"""Figures as the admin's pages show them: sizes in decimal units, dates in Django's own format."""

from datetime import datetime

from django.utils import formats, timezone

_SIZE_UNITS = ("kB", "MB", "GB", "TB", "PB")


def size_text(n: int | None) -> str:
    """1234567890 bytes as "1.2 GB". Decimal (a GB is 10^9 bytes), as the device line and the memory checks write a
    GPU's memory, so a model's size reads against the free memory beside it."""
    if n is None:
        return "–"
    if n < 1000:
        return f"{n} byte{'' if n == 1 else 's'}"
    value = n / 1000
    for unit in _SIZE_UNITS[:-1]:
        if round(value, 1) < 1000:
            return f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} {_SIZE_UNITS[-1]}"


def when_text(at: datetime | None, *, empty: str = "–") -> str:
    """A time as the admin shows its date fields ("Mar. 7, 2027, 12:59 p.m."), in the current time zone. A value a
    display method returns as a datetime would print as ISO text on a change page."""
    if at is None:
        return empty
    return formats.date_format(timezone.localtime(at), "DATETIME_FORMAT")
