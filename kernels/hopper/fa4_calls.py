"""Reading the arguments of a call of one of FA4's kernel methods, for the overrides that change
what the call hands on (dropout_sm90, fwd_persistent). Pure Python."""
from __future__ import annotations

import functools
import inspect


def call_arguments(method, kernel, args, kwargs) -> dict:
    """{name: value} of `method(kernel, *args, **kwargs)`, `self` included, whether FA4 passed
    them by position or by name."""
    return _signature(method).bind(kernel, *args, **kwargs).arguments


@functools.lru_cache(maxsize=None)
def _signature(method):
    return inspect.signature(method)
