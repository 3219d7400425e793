"""Checks of a command's input outside the job spec: directories it writes, ports it serves on, environment variables.

Each raises :class:`UsageError` with a message that names the flag or variable, the value and what to do; the
`daedalus` command prints it as one ``error:`` line (exit status 2) instead of a traceback. Torch-free, like
:mod:`daedalus_trainer.config`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

#: The range of a TCP port number; 0 asks the operating system for a free one where a command allows it.
PORT_MIN, PORT_MAX = 0, 65535


class UsageError(ValueError):
    """A command's input outside the job spec (a path, a port, an environment variable) cannot be used; the
    message says which, why, and what to do."""


def make_dir(path: str | Path, what: str) -> Path:
    """Create directory ``path`` with its parents (an existing directory is fine) and return it.

    Args:
        path: the directory.
        what: where the path came from, for the message (``"--runs-dir"``, ``"checkpoint.path"``).

    Raises:
        UsageError: a component of ``path`` is a file, or it cannot be created (permissions, read-only file system).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise UsageError(f"{what}: cannot create the directory {path}: {blocker} is a file, not a directory") from None
    except OSError as exc:
        raise UsageError(f"{what}: cannot create the directory {path}: {exc.strerror or exc}") from None
    return path


def new_dirs(path: str | Path) -> Path | None:
    """The outermost directory that :func:`make_dir` would create for ``path`` (``path`` itself or one of its
    parents), or None when ``path`` exists: what :func:`remove_empty_dirs` may take away again."""
    path = Path(path).absolute()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    return missing[-1] if missing else None


def remove_empty_dirs(path: str | Path, top: Path | None) -> None:
    """Remove ``path`` and its parents up to ``top`` (included) while they are empty directories: undoes a
    :func:`make_dir` whose command then failed before it wrote anything there. Never raises."""
    if top is None:
        return
    path = Path(path).absolute()
    for p in (path, *path.parents):
        try:
            p.rmdir()  # only an empty directory
        except OSError:
            return
        if p == top:
            return


def port_number(text: str | int, what: str) -> int:
    """``text`` as a TCP port number (0-65535).

    Raises:
        UsageError: not a whole number, or outside 0-65535.
    """
    try:
        port = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{what}={text!r} is not a port number ({PORT_MIN}-{PORT_MAX})") from None
    if not PORT_MIN <= port <= PORT_MAX:
        raise UsageError(f"{what}={port} is outside the port numbers {PORT_MIN}-{PORT_MAX}")
    return port


def env_number(name: str, default: float, *, integer: bool = False, minimum: float | None = None) -> float:
    """The environment variable ``name`` as a number (``default`` when unset or empty).

    Raises:
        UsageError: not a number (``integer``: not a whole number), or below ``minimum``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not {'a whole number' if integer else 'a number'}") from None
    if value != value or (minimum is not None and value < minimum):  # NaN, or too small
        raise UsageError(f"{name}={raw!r} must be at least {minimum:g}")
    return value


def check_port_free(host: str, port: int, what: str) -> None:
    """Fail now, before minutes of start-up, if ``host:port`` cannot be served on (port 0 always can). Binds as
    :class:`http.server.HTTPServer` does (``SO_REUSEADDR``), so a port in TIME_WAIT is not reported as taken.

    Raises:
        UsageError: the port is taken or not allowed (e.g. below 1024 without the privilege).
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UsageError(f"cannot serve on {host}:{port} ({exc.strerror or exc}); set {what} to a free port") \
                from None


def quiet_single_threaded_torch(*, warnings: bool = True) -> None:
    """Set up torch and transformers for a command on a laptop-class CPU: one torch thread unless ``OMP_NUM_THREADS``
    says otherwise (2 threads were 10-70x slower here when another process was busy; docs/engineering-notes.md,
    "Torch threads on a shared CPU"), and none of transformers' or the Hub's own progress bars (a "Loading weights"
    bar per model load, "Writing model shards" per save), which would interleave with the command's own. With
    ``warnings=False`` transformers logs errors only (``daedalus run``, whose screen is a live progress display).
    """
    if not os.environ.get("OMP_NUM_THREADS", "").strip():  # unset, or set to nothing (OMP_NUM_THREADS=$UNSET)
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    torch.set_num_threads(_omp_threads(os.environ["OMP_NUM_THREADS"]))
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if not warnings:
        transformers.utils.logging.set_verbosity_error()


def _omp_threads(value: str) -> int:
    """The thread count ``OMP_NUM_THREADS`` asks for: its first level (OpenMP's nested form ``4,2`` is 4 threads
    here), 1 when that is not a whole number >= 1 (an unusable value costs speed, not the command)."""
    first = value.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) >= 1 else 1


def _umask_from_proc() -> int | None:
    """The file-creation mask as Linux reports it (``/proc/self/status``, without changing it); None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _umask_by_setting() -> int:
    """The file-creation mask read by setting it and putting it back (a new file of another thread in that instant
    would get mode 0644/0755): done once, at import, where /proc does not give it."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _umask_by_setting() if _umask_from_proc() is None else None


def current_umask() -> int:
    """The process's file-creation mask (e.g. ``0o022``): from ``/proc/self/status`` on Linux, elsewhere the mask the
    process had when this module was imported."""
    mask = _umask_from_proc()
    return mask if mask is not None else (_UMASK_AT_IMPORT if _UMASK_AT_IMPORT is not None else _umask_by_setting())


def restore_umask_modes(directory: str | os.PathLike[str]) -> None:
    """Give the ``*.safetensors`` files directly in ``directory`` that are private (mode 0600) the mode the process's
    umask gives a new file (0644 under the usual 022). safetensors 0.8 writes its files with mode 0600 whatever the
    umask, so a model or adapter saved by ``save_pretrained`` could not be read by another user of a shared volume
    (vLLM serving pods run as another uid) while every other file beside it could. Best effort: a file that cannot be
    changed (owned by another user, a file system without modes) keeps its mode, with a warning."""
    import logging

    mode = 0o666 & ~current_umask()
    if mode == 0o600:
        return
    for f in Path(directory).glob("*.safetensors"):
        try:
            if f.is_file() and not f.is_symlink() and (f.stat().st_mode & 0o777) == 0o600:
                os.chmod(f, mode)
        except OSError as exc:
            logging.getLogger(__name__).warning("%s keeps mode 0600 (%s): other users cannot read it", f,
                                                exc.strerror or exc)
