"""The functional KV cache: see :mod:`kvjax.cache.kv`."""

from kvjax.cache.kv import *  # noqa: F401,F403
from kvjax.cache.kv import __all__  # noqa: F401
