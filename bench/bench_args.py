"""argparse types shared by the benchmark scripts.

A bad value is refused by argparse itself (one line naming the option, exit
status 2) before any work starts, instead of failing later with a traceback.
"""

from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of ints >= 1 ('1,64,256')."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 (e.g. '1,64,256'); "
                                         f"got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1; got {text!r}")
    return values


def positive_int(text: str) -> int:
    """One int >= 1."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer >= 1; got {text!r}")
    return values[0]


def non_negative_int(text: str) -> int:
    """One int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected one integer >= 0; got {text!r}")
    return value


def _number(text: str, fits, want: str) -> float:
    """`text` as a float for which `fits` holds; an ArgumentTypeError saying `want` otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # fits nothing
    if not fits(value):
        raise argparse.ArgumentTypeError(f"expected {want}; got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A float > 0."""
    return _number(text, lambda v: v > 0, "a number > 0")


def fraction(text: str) -> float:
    """A float in [0, 1]."""
    return _number(text, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def int_range(text: str) -> tuple[int, int]:
    """'LO,HI': two ints with 1 <= LO <= HI."""
    values = positive_ints(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI; got {text!r}")
    return values[0], values[1]


def subset_of(*allowed: str):
    """A comma-separated list of `allowed` names -> tuple of them."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(text.split(","))
        if not set(names) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected names of {', '.join(allowed)}; got {text!r}")
        return names

    return parse


BACKENDS = ("pallas", "interpret", "xla")
