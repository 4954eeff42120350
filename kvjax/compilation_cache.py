"""JAX's persistent compilation cache for kvjax's entry points and notebooks.

Compiling dominates a short run on a CPU (the main job compiles its prefill, generate
loop, single step and long-context steps; serve its engine's programs), and nothing of it
outlived the process. :func:`enable` points ``jax_compilation_cache_dir`` at
``$KVJAX_CACHE/jax`` (default ``~/.cache/kvjax/jax``, beside the weights and the planner's
picks), so a second run loads its executables from disk instead of compiling them.

Set once at start-up, before anything compiles: every ``experiments/*`` entry point calls
it through ``experiments.cli.run`` (its flag ``--compilation_cache=false`` turns it off),
and :mod:`kvjax.api` when it loads a model. ``$KVJAX_COMPILATION_CACHE`` overrides the
folder: a path, or ``0`` / ``off`` / ``false`` for no persistent cache (the test suite
points it at a temporary folder, so tests never write to the user's cache).
"""

from __future__ import annotations

import logging
import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

from kvjax.checkpoints import fetch

ENV = "KVJAX_COMPILATION_CACHE"
"""Environment variable: the cache folder, or one of :data:`OFF_VALUES`."""
OFF_VALUES = ("0", "off", "false", "no", "")
SUBDIR = "jax"
"""The folder under ``$KVJAX_CACHE`` (:func:`kvjax.checkpoints.fetch.cache_dir_path`)."""
MIN_COMPILE_SECONDS = 0.5
"""Programs that compile faster than this are not written (JAX's default is 1 s; the main
job's single steps compile in 0.5-2 s on a 2-core CPU and are worth keeping, the many tiny
eager programs are not: reading an entry costs a file open)."""

_state: dict = {}


def default_dir() -> pathlib.Path | None:
    """The folder :func:`enable` uses: ``$KVJAX_COMPILATION_CACHE`` when set (None for
    one of :data:`OFF_VALUES`), else ``$KVJAX_CACHE/jax`` or ``~/.cache/kvjax/jax``."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in OFF_VALUES else pathlib.Path(env).expanduser()
    return fetch.cache_dir_path() / SUBDIR


def enable(path: str | os.PathLike | None = None, on: bool = True) -> pathlib.Path | None:
    """Turns JAX's persistent compilation cache on at ``path`` (default
    :func:`default_dir`), or off with ``on=False`` or where :func:`default_dir` is None.
    Returns the folder in use (None: off). Call it before anything compiles; a later call
    changes the folder for the programs compiled after it (JAX's cache is reset).

    Raises:
      OSError: the folder cannot be created.
    """
    folder = (pathlib.Path(path).expanduser() if path is not None else default_dir()) \
        if on else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_enable_compilation_cache", folder is not None)
    # whatever was initialised before takes the new setting; JAX logs the reset at INFO,
    # which absl's handler would print above an entry point's one-line error
    log = logging.getLogger("jax._src.compilation_cache")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        cc.reset_cache()
    finally:
        log.setLevel(level)
    _state["dir"] = folder
    return folder


def current() -> pathlib.Path | None:
    """The folder :func:`enable` last set (None: off, or never enabled)."""
    return _state.get("dir")
