"""Date-times between replicator's one ISO 8601 form (replicator.structure) and the numbers and
texts Debezium's PostgreSQL connector writes for them: days, milli- and microseconds since
1970-01-01 in the proleptic Gregorian calendar with astronomical years (1 BC is year 0, as
Java's java.time counts), times of day in UTC, and intervals as Debezium's MicroDuration."""

from __future__ import annotations

import re

DAY_MICROS = 86_400_000_000
_DAYS_PER_MONTH = 365.25 / 12.0    # MicroDuration's month: the Gregorian year's average
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (any astronomical year)."""
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """The proleptic Gregorian date `days` after 1970-01-01."""
    days += 719_468
    era = days // 146_097
    day_of_era = days - era * 146_097
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36_524 - day_of_era // 146_096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = shifted_month + (3 if shifted_month < 10 else -9)
    return year_of_era + era * 400 + (month <= 2), month, day


def _year_text(year: int) -> str:
    """ISO 8601's year: four digits, a sign outside 0000-9999 (as structure._year)."""
    if year < 0:
        return f"-{-year:04d}"
    return f"{year:04d}" if year <= 9999 else f"+{year}"


def _date_parts(text: str) -> tuple[int, int, int, int]:
    """Year, month, day of "2024-01-02...", "-0043-03-15..." or "+10000-01-01...", and where
    the date ends."""
    end = text.index("-", 1) if text[0] in "+-" else 4
    return int(text[:end]), int(text[end + 1:end + 3]), int(text[end + 4:end + 6]), end + 6


def epoch_days(date: str) -> int:
    """Days since 1970-01-01 of a date in the one form."""
    year, month, day, _ = _date_parts(date)
    return _days_from_civil(year, month, day)


def date_text(days: int) -> str:
    """The one form of the date `days` after 1970-01-01."""
    year, month, day = _civil_from_days(days)
    return f"{_year_text(year)}-{month:02d}-{day:02d}"


def clock_micros(clock: str) -> int:
    """Microseconds since midnight of "HH:MM:SS.ffffff" (24:00:00 is a whole day)."""
    return (int(clock[:2]) * 3600 + int(clock[3:5]) * 60 + int(clock[6:8])) * 1_000_000 + int(clock[9:15])


def clock_text(micros: int) -> str:
    """"HH:MM:SS.ffffff" of microseconds since midnight (a whole day is 24:00:00)."""
    seconds, fraction = divmod(micros, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{second:02d}.{fraction:06d}"


def epoch_micros(timestamp: str) -> int:
    """Microseconds since 1970-01-01T00:00:00 of a timestamp in the one form (its offset, if
    any, not read: timestamptz values are in UTC)."""
    year, month, day, end = _date_parts(timestamp)
    return _days_from_civil(year, month, day) * DAY_MICROS + clock_micros(timestamp[end + 1:end + 16])


def timestamp_text(micros: int) -> str:
    """The one form of the timestamp `micros` after 1970-01-01T00:00:00."""
    days, clock = divmod(micros, DAY_MICROS)
    return f"{date_text(days)}T{clock_text(clock)}"


_TIMETZ = re.compile(r"(\d\d):(\d\d):(\d\d)\.(\d{6})([+-])(\d\d):(\d\d)(?::(\d\d))?")


def utc_clock(timetz: str) -> str:
    """A timetz in the one form as Debezium's ZonedTime: the time of day in UTC, the fraction's
    digits as java.time prints them (none when zero, trailing zeros dropped), then "Z";
    24:00:00 in UTC stays 24:00:00Z."""
    m = _TIMETZ.fullmatch(timetz)
    if m is None:
        raise ValueError(f"not a time with time zone in the one form: {timetz!r}")
    hour, minute, second, fraction, sign, oh, om, osec = m.groups()
    seconds = int(hour) * 3600 + int(minute) * 60 + int(second)
    offset = int(oh) * 3600 + int(om) * 60 + int(osec or 0)
    if seconds != 86_400 or offset:
        seconds = (seconds - offset if sign == "+" else seconds + offset) % 86_400
    digits = fraction.rstrip("0")
    minutes, second_utc = divmod(seconds, 60)
    text = f"{minutes // 60:02d}:{minutes % 60:02d}:{second_utc:02d}"
    return f"{text}.{digits}Z" if digits else f"{text}Z"


def timetz_from_utc(clock: str) -> str:
    """The one form of a ZonedTime ("11:04:05.1Z") at offset +00:00."""
    body = clock[:-1]
    fraction = body[9:] if len(body) > 8 else ""
    return f"{body[:8]}.{fraction.ljust(6, '0')}+00:00"


_INTERVAL_UNIT = re.compile(r"([+-]?\d+) (year|mon|day)s?")
_INTERVAL_CLOCK = re.compile(r"([+-])?(\d+):(\d\d):(\d\d(?:\.\d+)?)")


def interval_micros(interval: str) -> int:
    """Debezium's MicroDuration of an interval as PostgreSQL writes it with IntervalStyle
    'postgres' ("1 year 2 mons -3 days +04:05:06.5"): a month is 365.25 / 12 days, computed
    in doubles in the order Debezium computes, truncated toward zero into 64 bits."""
    units = {"year": 0, "mon": 0, "day": 0}
    for number, unit in _INTERVAL_UNIT.findall(interval):
        units[unit] = int(number)
    hours = minutes = 0
    seconds = 0.0
    clock = _INTERVAL_CLOCK.search(interval)
    if clock is not None:
        sign = -1 if clock[1] == "-" else 1
        hours, minutes, seconds = sign * int(clock[2]), sign * int(clock[3]), sign * float(clock[4])
    days = (units["year"] * 12 + units["mon"]) * _DAYS_PER_MONTH + units["day"]
    total = (((days * 24 + hours) * 60) + minutes) * 60 + seconds
    return min(max(int(total * 1e6), _INT64_MIN), _INT64_MAX)


def clock_interval_text(micros: int) -> str:
    """An interval of hours, minutes and seconds only, as PostgreSQL writes it with
    IntervalStyle 'postgres' ("-00:00:01.5", "100:00:00")."""
    sign = "-" if micros < 0 else ""
    seconds, fraction = divmod(abs(micros), 1_000_000)
    minutes, second = divmod(seconds, 60)
    text = f"{sign}{minutes // 60:02d}:{minutes % 60:02d}:{second:02d}"
    return f"{text}.{fraction:06d}".rstrip("0") if fraction else text
