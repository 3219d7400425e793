"""Crash-safe training checkpoints: save, verify, rotate, resume, export (DESIGN §4 "Checkpoints").

Layout under a checkpoint root (e.g. ``runs/<name>/checkpoints`` locally, the FSx claim's ``checkpoint.path`` on a
cluster)::

    <root>/
      latest                    one line: the directory name of the last committed checkpoint, e.g. "step-000120"
      step-000120/
        adapter/                PEFT adapter directory, servable by vLLM (``enable_lora``) and ``PeftModel``
          adapter_config.json
          adapter_model.safetensors
        optimizer.pt            ``torch.save(optimizer.state_dict())``; read back with ``weights_only=True``
        trainer_state.json      step, sampler state, RNG states (python, numpy, torch), metric history
        MANIFEST.json           relative path, size in bytes and sha256 of every other file

Write protocol (one writer per root; the operator stops a Ray job before it submits the next attempt):

1. every file is written into ``<root>/.tmp-step-NNNNNN-<random>/`` (same file system, so the rename is atomic);
   a root that does not exist yet is created with its missing parents, each fsynced into its parent as it is made
   (:func:`_make_dirs`), so a power loss after the commit cannot take the new directory entries with it;
2. every file is fsynced, then ``MANIFEST.json``, then the directories (POSIX ``fsync(2)``; a rename is only durable
   once the parent directory is fsynced too);
3. the temporary directory is renamed to ``step-NNNNNN`` and the root is fsynced;
4. ``latest`` is replaced by write-temp + fsync + ``os.replace`` + fsync of the root (``rename(2)`` is atomic);
5. checkpoints beyond the newest ``keep`` are deleted, never the one ``latest`` names.

A failure at any point (a full disk, ``ENOSPC``, included) removes what this save wrote, leaves every earlier
checkpoint and the ``latest`` pointer as they were, and raises :class:`CheckpointSaveError`.

Reading: :func:`load_latest` verifies candidates newest first against their manifest and falls back to older ones,
logging (``logging.warning``) which file was bad and why. Checkpoints the resumed run does not continue belong to
an abandoned timeline (all of them with ``resume: none``; after an explicit older ``PATH`` or a corrupt one we fell
back from, those of a later step): :meth:`CheckpointManager.abandon_other_timelines` renames them to
``abandoned-step-NNNNNN-<utc>-<id>`` (never deletes them; :func:`delete_abandoned`, ``daedalus checkpoints
--delete-abandoned``, does on request) before the run starts, and :meth:`CheckpointManager.save`
does the same to any of the same or a higher step, so that ``resume: latest`` continues the run that is actually
going on. Saving again the step ``latest`` names (the newest) replaces it.

Only the LoRA adapter and its optimizer state are stored, so resuming does not depend on the number of GPUs.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import enum
import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Union

import numpy as np
import safetensors.torch
import torch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "OPTIMIZER",
    "TRAINER_STATE",
    "AdapterState",
    "PackedTensor",
    "AdapterWriter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "ManifestProblem",
    "Opener",
    "RootEntry",
    "TrainerState",
    "atomic_write_json",
    "atomic_write_text",
    "capture_rng_state",
    "checkpoint_dir_name",
    "delete_abandoned",
    "error_reason",
    "export_adapter",
    "inspect_root",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "read_latest_pointer",
    "resolve_resume",
    "restore_interrupted_export",
    "restore_rng_state",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "daedalus-checkpoint/1"
"""Value of ``format`` in MANIFEST.json and trainer_state.json; bump when the layout changes incompatibly."""

LATEST = "latest"
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""File names of the PEFT adapter format (peft ``CONFIG_NAME`` / ``SAFETENSORS_WEIGHTS_NAME``)."""

REQUIRED_FILES = (
    f"{ADAPTER_DIR}/{ADAPTER_CONFIG}",
    f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}",
    OPTIMIZER,
    TRAINER_STATE,
)
"""Paths (relative to a checkpoint directory) that a manifest must list for the checkpoint to be usable."""

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_HASH_CHUNK = 1 << 20
#: Files hashed at once by :func:`verify_checkpoint` (bounded by the CPU count).
_HASH_THREADS = 4

Opener = Callable[[Path, str], IO[bytes]]
"""``opener(path, mode) -> binary file object`` used for every file this module writes itself (mode is ``"wb"``).

The default is the built-in :func:`open`. The object must support ``write``, ``flush``, ``close`` and the context
manager protocol. Tests pass a wrapper that plays a full disk (raises
``OSError(ENOSPC)`` past a byte budget); production code never sets it. Files written by an :data:`AdapterWriter`
callable (e.g. ``PeftModel.save_pretrained``) do not go through it.
"""

AdapterWriter = Callable[[Path], None]
"""``writer(adapter_dir)`` writes a PEFT adapter into the given (existing, empty) directory, e.g.
``lambda d: peft_model.save_pretrained(d)``. It must produce ``adapter_config.json`` and
``adapter_model.safetensors``; any extra files (peft's README.md) are kept and listed in the manifest."""


# --------------------------------------------------------------------------------------------------------------------
# Errors and values
# --------------------------------------------------------------------------------------------------------------------


class CheckpointError(Exception):
    """Base class of every error this module raises on purpose."""


def error_reason(exc: BaseException, *, sentence: bool = False) -> str:
    """The short reason ``exc`` gives, to quote inside a one-line error message: the first line of its message
    (with ``sentence``, only that line's first sentence, up to the first ". "), without its closing full stop; the
    name of its type when the message is empty. Never raises."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    return (line.split(". ")[0] if sentence else line).rstrip(".")


class CheckpointSaveError(CheckpointError):
    """Saving failed; nothing of the failed save is left and earlier checkpoints and ``latest`` are unchanged.

    ``errno`` carries the underlying ``OSError.errno`` (``errno.ENOSPC`` for a full disk) or ``None``; the original
    exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, step: int, root: Path, errno_: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.root = root
        self.errno = errno_


@dataclasses.dataclass(frozen=True)
class ManifestProblem:
    """Why one file of a checkpoint fails verification.

    ``reason`` is one of ``"missing"``, ``"size mismatch"``, ``"sha256 mismatch"``, ``"unreadable JSON"``,
    ``"step mismatch"``, ``"not in manifest"``, ``"bad manifest"``; ``detail`` is a human-readable explanation.
    """

    file: str
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason} ({self.detail})"


class CheckpointCorruptError(CheckpointError):
    """A checkpoint (or every checkpoint under a root) failed manifest verification.

    ``problems`` maps each rejected checkpoint directory to its list of :class:`ManifestProblem`.
    """

    def __init__(self, message: str, problems: Mapping[Path, list[ManifestProblem]]) -> None:
        super().__init__(message)
        self.problems = dict(problems)


@dataclasses.dataclass(frozen=True)
class AdapterState:
    """A LoRA adapter as data: the tensors and the PEFT config.

    Attributes:
        tensors: name -> tensor in PEFT's saved key format (what ``peft.get_peft_model_state_dict(model)`` returns,
            e.g. ``base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight`` of shape
            ``[r, in_features]``; ``lora_B`` ``[out_features, r]``). Any device and dtype; written as-is (dtype kept)
            after ``detach().cpu().contiguous()``.
        config: the ``adapter_config.json`` content, e.g. ``peft_model.peft_config["default"].to_dict()``. Sets
            are written as sorted lists and enums as their values, as peft itself does.
    """

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class PackedTensor:
    """A tensor's bytes as a NumPy ``uint8`` array, for shipping through Ray's object store.

    Ray writes NumPy buffers into the object store out of band (one copy, none on the reading side: a ``ray.get``
    maps them read-only), while a ``torch.Tensor`` is pickled (copied through an in-band byte stream on both sides).
    Measured here for 1.04 GB of fp32 tensors returned by an actor: the actor was busy 0.13-0.69 s packed against
    2.2-3.8 s as tensors, and the ``ray.get`` took ~0 s against 1.3-4.9 s. Use :func:`pack_tensors` /
    :func:`unpack_tensors`.

    Attributes:
        data: ``uint8 [nbytes]``, the tensor's contiguous bytes (a view on the sender; read-only after ``ray.get``).
        dtype: torch dtype name, e.g. ``"float32"``, ``"bfloat16"`` (NumPy has no bfloat16: bytes carry any dtype).
        shape: the tensor's shape (``()`` for a 0-dim tensor such as AdamW's ``step``).
    """

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PackedTensor:
        """Pack ``tensor`` (any shape, 0-dim included; any device: moved to the CPU first; a view when it is already
        CPU and contiguous)."""
        t = tensor.detach().cpu().contiguous()
        return cls(t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def unpack(self) -> torch.Tensor:
        """A writable CPU tensor equal to the packed one, bit for bit, of shape :attr:`shape` (one copy out of the
        read-only buffer)."""
        dtype = getattr(torch, self.dtype)
        if len(self.data) == 0:  # no elements (a 0 in the shape): an empty byte tensor cannot be viewed as a dtype
            return torch.empty(self.shape, dtype=dtype)
        raw = torch.from_numpy(np.array(self.data, dtype=np.uint8, copy=True))
        return raw.view(dtype).reshape(self.shape)


def pack_tensors(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples; e.g. an adapter state dict or ``optimizer.state_dict()``) with every
    ``torch.Tensor`` replaced by a :class:`PackedTensor`; other leaves are returned as they are."""
    if isinstance(tree, torch.Tensor):
        return PackedTensor.of(tree)
    if isinstance(tree, Mapping):
        return {k: pack_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(pack_tensors(v) for v in tree)
    return tree


def unpack_tensors(tree: Any) -> Any:
    """The inverse of :func:`pack_tensors`: every :class:`PackedTensor` becomes a writable CPU tensor."""
    if isinstance(tree, PackedTensor):
        return tree.unpack()
    if isinstance(tree, Mapping):
        return {k: unpack_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(unpack_tensors(v) for v in tree)
    return tree


@dataclasses.dataclass
class TrainerState:
    """The JSON part of a checkpoint (``trainer_state.json``), everything except tensors.

    Attributes:
        sampler: state of the maze sampler (JSON-serialisable; e.g. ``{"seed": 7, "next_index": 96}``).
        rng: global RNG states as returned by :func:`capture_rng_state` (python, numpy, torch, torch_cuda).
        metric_history: one dict per completed step (e.g. ``{"step": 3, "reward_mean": 0.5, ...}``), oldest first;
            NaN and infinities are kept (written as the non-standard JSON tokens ``NaN``/``Infinity`` that Python
            reads back).
        extra: anything else the loop needs to continue bit-for-bit (JSON-serialisable).
    """

    sampler: dict[str, Any] = dataclasses.field(default_factory=dict)
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    metric_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json_dict(self, step: int) -> dict[str, Any]:
        """The document written to ``trainer_state.json`` for checkpoint ``step``."""
        return {
            "format": FORMAT,
            "step": step,
            "sampler": self.sampler,
            "rng": self.rng,
            "metric_history": self.metric_history,
            "extra": self.extra,
        }

    @classmethod
    def from_json_dict(cls, doc: Mapping[str, Any]) -> TrainerState:
        """Inverse of :meth:`to_json_dict` (the ``step`` key is read by the caller)."""
        return cls(
            sampler=dict(doc.get("sampler") or {}),
            rng=dict(doc.get("rng") or {}),
            metric_history=list(doc.get("metric_history") or []),
            extra=dict(doc.get("extra") or {}),
        )


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :meth:`CheckpointManager.save` wrote.

    Attributes:
        step: the training step the checkpoint holds (completed steps).
        path: absolute path of the ``step-NNNNNN`` directory.
        time: commit time, Unix seconds (``time.time()`` after ``latest`` was replaced).
        bytes: total size of all files in the checkpoint, MANIFEST.json included, in bytes.
        seconds: wall-clock duration of the save, in seconds.
    """

    step: int
    path: Path
    time: float
    bytes: int
    seconds: float

    @property
    def adapter_dir(self) -> Path:
        """The PEFT adapter directory inside the checkpoint."""
        return self.path / ADAPTER_DIR


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that passed manifest verification. Tensors are read lazily by the ``load_*`` methods.

    Attributes:
        step: the training step it holds.
        path: absolute path of the ``step-NNNNNN`` directory.
        time: commit time from the manifest, Unix seconds.
        bytes: total size of the checkpoint's files in bytes.
        trainer_state: the parsed ``trainer_state.json``.
        manifest: the parsed ``MANIFEST.json``.
    """

    step: int
    path: Path
    time: float
    bytes: int
    trainer_state: TrainerState
    manifest: Mapping[str, Any]

    @property
    def adapter_dir(self) -> Path:
        """The PEFT adapter directory (pass it to ``PeftModel.from_pretrained`` or vLLM's ``LoRARequest``)."""
        return self.path / ADAPTER_DIR

    def load_adapter_tensors(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The adapter tensors (PEFT key format, shapes as saved: for a ``Linear`` target ``lora_A``
        ``[r, in_features]`` and ``lora_B`` ``[out_features, r]``) on ``device``, via
        ``safetensors.torch.load_file``."""
        return safetensors.torch.load_file(self.adapter_dir / ADAPTER_WEIGHTS, device=device)

    def load_adapter_config(self) -> dict[str, Any]:
        """The parsed ``adapter_config.json``."""
        return json.loads((self.adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))

    def load_optimizer_state(self, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The optimizer ``state_dict`` (``torch.load(..., weights_only=True)``: tensors and plain containers only,
        no arbitrary unpickling). Pass it to ``optimizer.load_state_dict``."""
        return torch.load(self.path / OPTIMIZER, map_location=map_location, weights_only=True)

    @property
    def info(self) -> CheckpointInfo:
        """This checkpoint as a :class:`CheckpointInfo` (``seconds`` is 0: it was not saved by this process)."""
        return CheckpointInfo(step=self.step, path=self.path, time=self.time, bytes=self.bytes, seconds=0.0)


# --------------------------------------------------------------------------------------------------------------------
# RNG state (python, numpy, torch) as JSON
# --------------------------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states of ``random``, ``numpy.random`` (legacy global MT19937) and torch, JSON-serialisable.

    torch states are ``ByteTensor``s (5056 bytes for the CPU Mersenne Twister) stored as base64; CUDA states are
    included (one per visible device) only when CUDA is initialised. Restore with :func:`restore_rng_state`.
    """
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()
        ]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the global RNGs from a :func:`capture_rng_state` dict. Keys that are absent are left alone.

    Raises:
        ValueError: a state has the wrong shape or type.
    """
    try:
        if "python" in state:
            py = state["python"]
            random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        if "numpy" in state:
            n = state["numpy"]
            np.random.set_state(
                {
                    "bit_generator": n["bit_generator"],
                    "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": int(n["pos"])},
                    "has_gauss": int(n["has_gauss"]),
                    "gauss": float(n["gauss"]),
                }
            )
        if "torch" in state:
            raw = base64.b64decode(state["torch"])
            torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        if "torch_cuda" in state and torch.cuda.is_available():
            cuda_states = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                           for s in state["torch_cuda"]]
            if len(cuda_states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda_states)
            else:
                log.warning("not restoring CUDA RNG states: checkpoint has %d devices, this process sees %d",
                            len(cuda_states), torch.cuda.device_count())
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"invalid RNG state in checkpoint: {e}") from e


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def checkpoint_dir_name(step: int) -> str:
    """``step-NNNNNN``: the step zero-padded to 6 digits (more digits beyond 999999)."""
    return f"step-{step:06d}"


def _step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-NNNNNN`` directory under ``root``, oldest first; ``[]`` if ``root`` is absent.

    Lists directories only; says nothing about whether they verify (see :func:`verify_checkpoint`).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = _step_of(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry.absolute()))
    return sorted(found)


def read_latest_pointer(root: str | os.PathLike[str]) -> str | None:
    """The directory name the ``latest`` pointer holds, or ``None`` if there is no (valid) pointer."""
    try:
        name = (Path(root) / LATEST).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        log.warning("checkpoint pointer %s is unreadable: %s", Path(root) / LATEST, e)
        return None
    if _step_of(name) is None:
        log.warning("checkpoint pointer %s holds %r, not a step-NNNNNN name; ignoring it", Path(root) / LATEST, name)
        return None
    return name


#: errnos of a read that failed for the file system's or the permissions' sake, not the content's (load_latest does
#: not fall back past them): I/O error, stale NFS/Lustre handle, permission, not connected, timed out, busy, again.
READ_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EACCES, errno.EPERM, errno.ENOTCONN, errno.ETIMEDOUT,
                         errno.EBUSY, errno.EAGAIN, errno.ENODEV, errno.ENXIO})


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``, durably: each missing directory is created top-down and its parent directory fsynced right
    after (POSIX ``fsync(2)``: a new directory entry is only on the device once its parent is flushed; ext4, XFS and
    Lustre may otherwise lose it in a power loss, and with it everything renamed into the new directory). Existing
    directories cost nothing.

    Returns:
        The directories created, outermost first (``[]`` when ``path`` existed).

    Raises:
        FileExistsError: ``path`` or one of its parents exists and is not a directory.
        OSError: a directory could not be created or its parent not fsynced.
    """
    path = Path(path).absolute()
    missing: list[Path] = []
    here = path
    while not here.is_dir():
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    created = []
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            if not directory.is_dir():
                raise
            # made meanwhile by another process, which may have died before flushing its entry: flushed here too
            _fsync_path(directory.parent, directory=True)
            continue
        _fsync_path(directory.parent, directory=True)
        created.append(directory)
    return created


def _atomic_write(path: Path, write: Callable[[IO[str]], None]) -> None:
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # /dev/stdout, a pipe, a link the user set up: written through as given (a rename would replace the link,
        # and a sibling next to /dev/stdout cannot be created)
        with open(path, "w", encoding="utf-8") as f:
            write(f)
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        _fsync_path(path.parent, directory=True)
    except OSError as e:  # the file is replaced: raising now would report a write that happened as failed
        log.warning("could not fsync %s after replacing %s (%s): the new content may not survive a power loss",
                    path.parent, path.name, e)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace the file at ``path`` with ``text`` (UTF-8) so that a reader, or the next run after a ``kill -9``, a
    full disk or a power loss, sees the old content or the new, never part of it: written into the sibling
    ``<name>.tmp`` (same directory, so the rename is atomic; a leftover of an interrupted write is overwritten),
    fsynced, renamed over ``path`` with ``os.replace`` (``rename(2)``), then the directory is fsynced (a failure of
    that last fsync is logged, not raised: the file is already replaced). One writer per path assumed. A ``path``
    that is a symbolic link or not a regular file (``/dev/stdout``, a FIFO) is written through in place instead.

    Raises:
        OSError: the temporary file could not be written, flushed or renamed (``path`` is then untouched and the
            temporary file removed).
    """
    _atomic_write(Path(path), lambda f: f.write(text))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> None:
    """:func:`atomic_write_text` of ``obj`` as JSON (``json.dump`` with ``indent``, then a newline), serialised
    straight into the temporary file.

    Raises:
        TypeError, ValueError: ``obj`` is not JSON serialisable (``path`` is untouched, the temporary file removed).
        OSError: as :func:`atomic_write_text`.
    """
    def write(f: IO[str]) -> None:
        json.dump(obj, f, indent=indent)
        f.write("\n")

    _atomic_write(Path(path), write)


def identity_differences(saved: Mapping[str, Any] | None, now: Mapping[str, Any],
                         say: Mapping[str, str] | None = None) -> list[str]:
    """What differs between the run identity a checkpoint kept (``saved``: a flat ``{"section.field": value}``
    mapping, e.g. :func:`daedalus_trainer.grpo.run_identity`) and this run's (``now``), one line per field, sorted by
    field: ``"<field>: <saved> there, <now> in this job"``, or ``say[field]`` where given (a fingerprint whose values
    mean nothing to a reader). Fields only one side has (from another version of Daedalus) are not compared; no
    ``saved`` identity (an older checkpoint) differs in nothing.

    Used by the GRPO and SFT resumes to refuse a checkpoint that a run with other settings wrote.
    """
    if not saved:
        return []
    say = say or {}
    return [say.get(k) or f"{k}: {saved[k]!r} there, {now[k]!r} in this job"
            for k in sorted(set(saved) & set(now)) if saved[k] != now[k]]


def weight_files(directory: str | os.PathLike[str], *, by_content: bool) -> list[list[Any]]:
    """A fingerprint of the weight files (``*.safetensors``, ``*.bin``) directly in ``directory``, sorted by name:
    ``[name, sha256]`` each with ``by_content`` (an adapter: megabytes, exported again byte for byte the same), else
    ``[name, size in bytes, modification time in ns]`` (a full model: gigabytes cost no read, and any new save
    changes the time). Names, not paths: the same files seen from another directory are the same.

    Raises:
        OSError: the directory or a file cannot be read.
    """
    out: list[list[Any]] = []
    for f in sorted(Path(directory).iterdir()):
        if f.suffix in (".safetensors", ".bin") and f.is_file():
            if by_content:
                out.append([f.name, sha256_and_size(f)[0]])
            else:
                st = f.stat()
                out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def sha256_and_size(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """``(sha256 hex digest, size in bytes)`` of the file at ``path``, read in chunks (a checkpoint's optimizer state
    can be gigabytes); ``fsync``: also flush it to the device (a checkpoint's files before the rename).

    Raises:
        OSError: the file cannot be read (or flushed).
    """
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _dump_json(obj: Any, *, compact: bool = False) -> bytes:
    if compact:  # trainer_state.json: RNG states are long int lists, one per line would be ~10x larger
        text = json.dumps(obj, separators=(",", ":"), sort_keys=True, default=_json_default)
    else:
        text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default)
    return (text + "\n").encode("utf-8")


def _torch_save_bytes(obj: Mapping[str, Any]) -> bytes:
    """``torch.save`` into memory. Writing straight to a file would let torch's C++ zip writer turn an ``OSError``
    (``ENOSPC``) into ``RuntimeError: unexpected pos ...`` and lose the errno; the bytes are written by
    :meth:`CheckpointManager._write_bytes` instead. Costs one copy of the optimizer state in host memory (LoRA
    only: about twice the adapter)."""
    buffer = io.BytesIO()
    torch.save(dict(obj), buffer)
    return buffer.getvalue()


def _files_under(directory: Path) -> list[Path]:
    """Every regular file under ``directory``, sorted by relative POSIX path."""
    return sorted((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.relative_to(directory).as_posix())


def _trashed_name(entry: Path) -> str | None:
    """The name ``entry`` had before a replacement moved it aside (``.trash-<name>-<8 hex>``, a real directory),
    else ``None``."""
    if not (entry.name.startswith(_TRASH_PREFIX) and entry.is_dir() and not entry.is_symlink()):
        return None
    return entry.name[len(_TRASH_PREFIX):].rsplit("-", 1)[0]


def _remove_tree(path: Path) -> None:
    """Delete a directory so that no half-deleted ``step-*`` is ever visible: rename to ``.trash-*`` first."""
    if not path.exists():
        return
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------------------------------
# Verification and loading
# --------------------------------------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, list[ManifestProblem]]:
    mpath = path / MANIFEST
    try:
        doc = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, [ManifestProblem(MANIFEST, "missing", f"{mpath} does not exist")]
    except OSError as e:
        if e.errno in READ_ERRNOS:  # the file system's or the permissions' fault, not the content's: the caller decides
            raise
        return None, [ManifestProblem(MANIFEST, "unreadable JSON", str(e))]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [ManifestProblem(MANIFEST, "unreadable JSON", str(e))]
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        return None, [ManifestProblem(MANIFEST, "bad manifest", "no 'files' list")]
    if doc.get("format") != FORMAT:
        return None, [ManifestProblem(MANIFEST, "bad manifest", f"format {doc.get('format')!r}, expected {FORMAT!r}")]
    return doc, []


def _step_mismatch(path: Path, state_doc: Any) -> str | None:
    """Why ``trainer_state.json`` (parsed: ``state_doc``) disagrees with the step the directory's name
    ``step-NNNNNN`` encodes, or ``None`` when they agree, when the name encodes no step (an ``abandoned-*`` or
    ``.trash-*`` copy, a directory given by path) or when the state holds no integer ``step`` (left to
    :func:`load_checkpoint`, which reports it)."""
    named = _step_of(path.name)
    step = state_doc.get("step") if isinstance(state_doc, dict) else None
    if named is None or isinstance(step, bool) or not isinstance(step, int) or step == named:
        return None
    return f"{TRAINER_STATE} says step {step}, the directory name {path.name} says step {named}"


def verify_checkpoint(path: str | os.PathLike[str]) -> list[ManifestProblem]:
    """Check every file of a checkpoint against its MANIFEST.json: presence, size in bytes, sha256.

    Also requires the manifest to list every file in :data:`REQUIRED_FILES`, ``trainer_state.json`` /
    ``adapter_config.json`` to parse as JSON, and, where the directory is named ``step-NNNNNN``, the ``step`` of
    ``trainer_state.json`` to be NNNNNN (``"step mismatch"``: a directory renamed, or a state copied from another
    checkpoint, would resume at a step other than the one :func:`load_latest` chose it for). Reads every byte once
    (sha256 over the whole checkpoint; files are hashed on up to :data:`_HASH_THREADS` threads). Presence and size
    problems come first, then sha256, JSON and step ones, each group in manifest order.

    Returns:
        The problems found, empty when the checkpoint is usable.

    Raises:
        OSError: a file (MANIFEST.json included) could not be read for the file system's or the permissions' sake
            (:data:`READ_ERRNOS`: ``EIO``, ``EACCES``, ...), which says nothing about the checkpoint's content.
    """
    path = Path(path)
    doc, problems = _read_manifest(path)
    if doc is None:
        return problems
    listed: set[str] = set()
    to_hash: list[tuple[str, Path, str]] = []  # (relative path, file, manifest sha256) of files whose size matches
    for entry in doc["files"]:
        try:
            rel, size, sha = str(entry["path"]), int(entry["bytes"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            problems.append(ManifestProblem(MANIFEST, "bad manifest", f"malformed entry {entry!r}"))
            continue
        listed.add(rel)
        fpath = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            problems.append(ManifestProblem(rel, "bad manifest", "path escapes the checkpoint directory"))
            continue
        try:
            actual_size = fpath.stat().st_size
        except FileNotFoundError:
            problems.append(ManifestProblem(rel, "missing", f"{fpath} does not exist"))
            continue
        if actual_size != size:
            problems.append(ManifestProblem(rel, "size mismatch", f"{actual_size} bytes on disk, manifest says {size}"))
            continue
        to_hash.append((rel, fpath, sha))
    # The files are hashed concurrently: hashlib and file reads release the GIL, so a restore verifies the adapter
    # and the optimizer state (the two large files) in about the time of the larger one.
    workers = max(1, min(len(to_hash), os.cpu_count() or 1, _HASH_THREADS))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256") as pool:
        digests = list(pool.map(lambda item: sha256_and_size(item[1])[0], to_hash))
    for (rel, fpath, sha), actual_sha in zip(to_hash, digests):
        if actual_sha != sha:
            problems.append(ManifestProblem(rel, "sha256 mismatch", f"{actual_sha} on disk, manifest says {sha}"))
            continue
        if rel.endswith(".json"):
            try:
                parsed = json.loads(fpath.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                problems.append(ManifestProblem(rel, "unreadable JSON", str(e)))
                continue
            if rel == TRAINER_STATE:
                mismatch = _step_mismatch(path, parsed)
                if mismatch:
                    problems.append(ManifestProblem(rel, "step mismatch", mismatch))
    for rel in REQUIRED_FILES:
        if rel not in listed:
            problems.append(ManifestProblem(rel, "not in manifest", "required checkpoint file is not listed"))
    return problems


def load_checkpoint(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Verify and open one checkpoint directory (no fallback).

    Raises:
        CheckpointCorruptError: it fails verification (``problems`` says which files and why).
        CheckpointError: ``path`` is not a directory.
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {path} failed verification: " + "; ".join(map(str, problems)), {path: problems}
        )
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    state_doc = json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))
    step = int(state_doc["step"])
    total = sum(int(e["bytes"]) for e in manifest["files"]) + (path / MANIFEST).stat().st_size
    return LoadedCheckpoint(
        step=step,
        path=path,
        time=float(manifest.get("time", (path / MANIFEST).stat().st_mtime)),
        bytes=total,
        trainer_state=TrainerState.from_json_dict(state_doc),
        manifest=manifest,
    )


def load_latest(root: str | os.PathLike[str]) -> LoadedCheckpoint | None:
    """The newest (highest step) checkpoint under ``root`` whose manifest verifies.

    Each rejected candidate is logged with ``logging.warning`` naming the checkpoint, the bad file and why
    ("size mismatch", "sha256 mismatch", "missing", "unreadable JSON", "step mismatch", ...), then the next older one is
    tried.

    Returns:
        The checkpoint, or ``None`` when ``root`` holds no ``step-*`` directory at all (a fresh run).

    An I/O error while reading one (``EIO``, ``ESTALE``, ``EACCES``, ...: :data:`READ_ERRNOS`) says nothing about
    its content: no older checkpoint is used then (its steps would be trained again, and the caller would move the
    newer one aside), the call fails instead, to be retried once the file system answers.

    Raises:
        CheckpointCorruptError: checkpoints exist but none verifies (starting from scratch silently would lose
            the run; a human should look).
        CheckpointError: a checkpoint could not be read (an I/O error, listed above), nothing was tried after it.
    """
    root = Path(root)
    candidates = list(reversed(list_checkpoints(root)))
    if not candidates:
        log.info("no checkpoint under %s", root)
        return None
    pointer = read_latest_pointer(root)
    if pointer is not None and not (root / pointer).is_dir():
        log.warning("checkpoint pointer %s names %s, which does not exist", root / LATEST, pointer)
    rejected: dict[Path, list[ManifestProblem]] = {}
    for i, (step, path) in enumerate(candidates):
        try:
            loaded = load_checkpoint(path)
        except CheckpointCorruptError as e:
            problems = e.problems[path]
        except OSError as e:
            if e.errno in READ_ERRNOS:
                raise CheckpointError(
                    f"cannot read checkpoint {path}: {e}: an I/O error, which says nothing about the checkpoint's "
                    "content, so no older checkpoint was tried and nothing was moved aside; retry once the file "
                    "system answers (fix permissions for EACCES/EPERM)") from e
            name = Path(e.filename).name if e.filename else TRAINER_STATE
            problems = [ManifestProblem(name, "unreadable", f"{type(e).__name__}: {e}")]
        except (ValueError, KeyError, TypeError) as e:  # e.g. trainer_state.json lacking "step"
            problems = [ManifestProblem(TRAINER_STATE, "unreadable JSON", f"{type(e).__name__}: {e}")]
        else:
            if rejected:
                log.warning("resuming from older checkpoint %s after rejecting %d newer one(s)", path, len(rejected))
            if pointer is not None and pointer != path.name:
                log.info("checkpoint pointer names %s; resuming from the newest verified checkpoint, %s", pointer,
                         path.name)
            return loaded
        rejected[path] = problems
        fallback = candidates[i + 1][1].name if i + 1 < len(candidates) else "nothing"
        for p in problems:
            log.warning("checkpoint %s rejected: %s: %s (%s); falling back to %s", path, p.file, p.reason, p.detail,
                        fallback)
    raise CheckpointCorruptError(
        f"none of the {len(candidates)} checkpoint(s) under {root} verifies; refusing to start from scratch. To "
        "start over, run again with `--resume none` (they are renamed abandoned-step-*, never deleted); to continue "
        "from another copy, `--resume PATH`; on a cluster, move the directory aside or create the job under a new "
        f"name (`daedalus checkpoints {root}` lists each one and why it fails)",
        rejected,
    )


def resolve_resume(resume: str, root: str | os.PathLike[str]) -> LoadedCheckpoint | None:
    """Apply the ``--resume`` option: ``latest`` | ``none`` | ``PATH``.

    - ``latest``: :func:`load_latest` on ``root`` (``None`` if there is no checkpoint yet).
    - ``none``: start fresh, ``None``. (:meth:`CheckpointManager.abandon_other_timelines` then moves the old run's
      checkpoints aside.)
    - ``PATH``: a checkpoint directory (holds MANIFEST.json) loaded without fallback, or another checkpoint root
      (holds ``step-*`` directories) whose newest verifying checkpoint is loaded.

    Raises:
        CheckpointError: ``PATH`` does not exist, is a file or holds no checkpoint; CheckpointCorruptError: it
            fails verification.
    """
    if resume == "none":
        return None
    if resume == "latest":
        return load_latest(root)
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"resume path {path} does not exist (expected 'latest', 'none' or a checkpoint path)")
    if not path.is_dir():
        raise CheckpointError(f"resume path {path} is a file; give a checkpoint directory (step-NNNNNN, with "
                              f"{MANIFEST}) or a checkpoints/ root holding such directories")
    if (path / MANIFEST).exists() or _step_of(path.name) is not None:
        return load_checkpoint(path)
    loaded = load_latest(path)
    if loaded is None:
        raise CheckpointError(f"resume path {path} holds no checkpoint (no step-NNNNNN directory)")
    return loaded


# --------------------------------------------------------------------------------------------------------------------
# Inspecting a root (``daedalus checkpoints``)
# --------------------------------------------------------------------------------------------------------------------

_ABANDONED_DIR = re.compile(r"^abandoned-step-(\d{6,})-")


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` names a checkpoint directory: ``step-NNNNNN`` or ``abandoned-step-NNNNNN-<utc>-<id>``
    (not the ``.tmp-*`` / ``.trash-*`` of a save or deletion in progress)."""
    return _step_of(name) is not None or _ABANDONED_DIR.match(name) is not None


@dataclasses.dataclass(frozen=True)
class RootEntry:
    """One directory under a checkpoint root, as :func:`inspect_root` found it.

    ``kind`` is ``"checkpoint"`` (``step-NNNNNN``: what ``resume: latest`` chooses from), ``"replaced"`` (a
    ``.trash-step-NNNNNN-*`` that a re-save of its step moved aside and a kill left without a ``step-NNNNNN``: the
    next resume puts it back, so it counts as that checkpoint), ``"abandoned"`` (``abandoned-step-NNNNNN-<utc>-<id>``:
    a timeline a run did not continue, kept until deleted by hand or :func:`delete_abandoned`) or ``"leftover"``
    (another ``.tmp-*`` / ``.trash-*``: an interrupted save or deletion, removed by the next save). ``step`` comes
    from the name (``None`` for leftovers); ``bytes`` is the sum of the file sizes under the directory (``st_size``,
    bytes); ``time`` is the manifest's commit time (seconds since the epoch), or ``None`` without a readable
    manifest. ``problems`` is why a resume would reject it (:func:`load_checkpoint`'s checks: the manifest, every
    file's size and sha256, the trainer state's step; empty: it loads; ``None``: not verified: leftovers, or
    ``verify=False``); ``error`` an I/O error that stopped the reading (:data:`READ_ERRNOS`: it says nothing of the
    content). ``latest``: the ``latest`` pointer names it; ``chosen``: ``resume: latest`` would resume from it (the
    newest that loads, as :func:`load_latest` picks; only set when verifying).
    """

    name: str
    path: Path
    kind: str
    step: int | None
    bytes: int
    time: float | None
    problems: tuple[ManifestProblem, ...] | None
    error: str | None = None
    latest: bool = False
    chosen: bool = False


def _tree_bytes(path: Path) -> int:
    """The bytes on disk under ``path`` (``st_size`` of every file, stray ones included: what deleting it frees).
    A stat per file, no reads; the manifest's sizes would leave out files it does not list."""
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:  # vanished meanwhile (a concurrent save's clean-up) or unreadable: not counted
            pass
    return total


def _manifest_time(path: Path) -> float | None:
    try:
        doc = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        return float(doc["time"]) if isinstance(doc, dict) and "time" in doc else None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return None


def _load_problems(path: Path) -> tuple[ManifestProblem, ...]:
    """Why :func:`load_latest` would reject the checkpoint at ``path`` (empty: it loads), with its classification.

    Raises:
        OSError: a read failed for the file system's or the permissions' sake (:data:`READ_ERRNOS`), or the
            directory went away meanwhile (``FileNotFoundError``: rotated by a running save).
    """
    try:
        load_checkpoint(path)
    except CheckpointCorruptError as e:
        return tuple(e.problems[path.absolute()])
    except OSError as e:
        if e.errno in READ_ERRNOS or not path.is_dir():
            raise
        return (ManifestProblem(Path(e.filename).name if e.filename else TRAINER_STATE, "unreadable",
                                f"{type(e).__name__}: {e}"),)
    except (ValueError, KeyError, TypeError) as e:  # e.g. trainer_state.json lacking an integer "step"
        return (ManifestProblem(TRAINER_STATE, "unreadable JSON", f"{type(e).__name__}: {e}"),)
    return ()


def inspect_root(root: str | os.PathLike[str], *, verify: bool = True) -> list[RootEntry]:
    """Every checkpoint, replaced, abandoned and leftover directory under ``root``, sorted by kind (checkpoints and
    replaced ones by step, then abandoned, then leftovers). Reads; changes nothing (the ``latest`` pointer, a
    leftover, a replaced checkpoint: all left as they are), so it is safe beside a running trainer: a directory that
    a running save rotates away while it is read is left out.

    Args:
        root: a checkpoint root (``runs/<name>/checkpoints``; on a cluster ``<checkpoint.path>/<namespace>/<name>/
            checkpoints``).
        verify: check every ``step-*``, replaced and ``abandoned-*`` directory as a resume would (reads every byte
            once, sha256) and mark the one ``resume: latest`` would choose.

    Returns:
        The entries; ``[]`` for an empty root.

    Raises:
        CheckpointError: ``root`` does not exist or is not a directory.
    """
    root = Path(root).absolute()
    if not root.is_dir():
        raise CheckpointError(f"{root} does not exist or is not a directory")
    pointer = read_latest_pointer(root)
    entries: list[RootEntry] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():  # a symlink to a directory counts, as list_checkpoints counts it
            continue
        name = entry.name
        step = _step_of(name)
        abandoned = _ABANDONED_DIR.match(name)
        replaced = _trashed_name(entry)
        if step is not None:
            kind = "checkpoint"
        elif abandoned:
            kind, step = "abandoned", int(abandoned.group(1))
        elif replaced is not None and _step_of(replaced) is not None and not (root / replaced).exists():
            kind, step = "replaced", _step_of(replaced)
        elif name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            kind = "leftover"
        else:
            continue
        problems: tuple[ManifestProblem, ...] | None = None
        error = None
        if verify and kind != "leftover":
            try:
                problems = _load_problems(entry)
            except OSError as e:
                if not entry.is_dir():
                    continue  # rotated away by a running save while it was read: no longer there
                error = f"{type(e).__name__}: {e}"
            if problems and not entry.is_dir():
                continue
        entries.append(RootEntry(name=name, path=entry, kind=kind, step=step, bytes=_tree_bytes(entry),
                                 time=_manifest_time(entry) if kind != "leftover" else None, problems=problems,
                                 error=error, latest=name == pointer))
    order = {"checkpoint": 0, "replaced": 0, "abandoned": 1, "leftover": 2}
    entries.sort(key=lambda e: (order[e.kind], -1 if e.step is None else e.step, e.name))
    if verify:
        # load_latest's choice (after CheckpointManager.resume puts a replaced one back): the newest that loads,
        # unless an I/O error stops it first.
        for i in range(len(entries) - 1, -1, -1):
            e = entries[i]
            if e.kind not in ("checkpoint", "replaced"):
                continue
            if e.error is not None:
                break
            if e.problems == ():
                entries[i] = dataclasses.replace(e, chosen=True)
                break
    return entries


def delete_abandoned(root: str | os.PathLike[str]) -> tuple[list[RootEntry], list[tuple[RootEntry, str]]]:
    """Delete every ``abandoned-step-*`` directory under ``root`` (the timelines runs did not continue, which
    :class:`CheckpointManager` never deletes itself). Each is renamed to ``.trash-*`` first, so no half-deleted
    directory keeps its name. ``step-*`` checkpoints, the ``latest`` pointer and leftovers are not touched: safe
    beside a running trainer, which only ever renames directories *to* ``abandoned-*`` (but not beside a run that
    was started with ``--resume`` naming an abandoned directory and has not loaded it yet). Symbolic links are left.

    Returns:
        ``(deleted, failed)``: the entries deleted (not verified: ``problems`` is ``None``), with their sizes in
        bytes; and those that could not be (wholly) deleted, with why (what is left of one is a ``.trash-*``
        directory that the next save's clean-up removes).

    Raises:
        CheckpointError: ``root`` does not exist or is not a directory.
    """
    deleted: list[RootEntry] = []
    failed: list[tuple[RootEntry, str]] = []
    for entry in inspect_root(root, verify=False):
        if entry.kind != "abandoned" or entry.path.is_symlink():
            continue
        trash = entry.path.with_name(f"{_TRASH_PREFIX}{entry.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(entry.path, trash)
            shutil.rmtree(trash)
        except OSError as e:
            failed.append((entry, f"{type(e).__name__}: {e}"))
            continue
        log.info("deleted %s (%d bytes)", entry.path, entry.bytes)
        deleted.append(entry)
    if deleted or failed:
        _fsync_path(Path(root).absolute(), directory=True)
    return deleted, failed


# --------------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves checkpoints under ``root`` with the crash-safe protocol in the module docstring and keeps the last
    ``keep``.

    Args:
        root: checkpoint root directory (created on first save).
        keep: how many checkpoints to keep, >= 1 (DESIGN spec ``checkpoint.keep``).
        opener: see :data:`Opener`; tests only.

    Raises:
        ValueError: ``keep`` < 1.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 3, *, opener: Opener = open) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.root = Path(root).absolute()
        self.keep = keep
        self._open = opener

    # Reading is the module functions; here for symmetry.
    def load_latest(self) -> LoadedCheckpoint | None:
        """:func:`load_latest` on this root."""
        return load_latest(self.root)

    def resume(self, resume: str | LoadedCheckpoint) -> LoadedCheckpoint | None:
        """:func:`resolve_resume` on this root (reads and verifies; moves nothing: call
        :meth:`abandon_other_timelines` once everything that could refuse the run has accepted it). A
        :class:`LoadedCheckpoint` (one the caller has already read and verified) is returned as it is.

        A checkpoint that a re-save of its own step had moved to ``.trash-*`` when the process died, before the new
        copy took its place, is put back first (:meth:`_restore_replaced`), in both cases: the run then moves it
        aside with the rest of a timeline it does not continue, rather than a later save's clean-up putting it back
        inside the new one.

        Raises:
            CheckpointError: see :func:`resolve_resume`.
        """
        self._restore_replaced()
        return resume if isinstance(resume, LoadedCheckpoint) else resolve_resume(resume, self.root)

    def _restore_replaced(self) -> None:
        """Put back ``.trash-step-N-*`` as ``step-N`` where ``step-N`` is missing and it verifies: a save of a step
        that already had a checkpoint renames the old one to ``.trash-*`` just before renaming the new one in; a
        kill between the two renames left neither name, and the next save's clean-up would have deleted it."""
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            name = _trashed_name(entry)
            if name is None or _step_of(name) is None or (self.root / name).exists() or verify_checkpoint(entry):
                continue
            log.warning("restoring %s as %s: a save of the same step was interrupted before its new copy was in "
                        "place", entry.name, name)
            os.rename(entry, self.root / name)
            _fsync_path(self.root, directory=True)

    def abandon_other_timelines(self, loaded: LoadedCheckpoint | None) -> None:
        """Move aside every checkpoint here that a run resumed from ``loaded`` (``None``: a fresh start) does not
        continue, and point ``latest`` at ``loaded``: renamed ``abandoned-*``, never deleted. With ``None``, or a
        checkpoint from elsewhere (another root, an ``abandoned-*`` directory), that is all of them; with one of this
        root's own ``step-*`` directories (a symlink to one counts as it), those of a later step.

        Done before the first step, not at the first save, so that a run interrupted before it saves is not followed
        by a ``latest`` resume of the timeline it replaced.

        Raises:
            OSError: a rename failed.
        """
        if not self.root.is_dir():
            return
        here = list_checkpoints(self.root)
        own = None
        if loaded is not None:
            target = loaded.path.resolve()
            own = next((path for _, path in here if path.resolve() == target), None)
        others = [path for step, path in here if own is None or (path != own and step >= loaded.step)]
        if others:
            self._move_aside(others, "the run resumes from another checkpoint" if loaded is not None
                             else "the run starts fresh (resume: none)")
        if own is not None:
            if read_latest_pointer(self.root) != own.name:
                self._write_pointer(own.name)
        elif (self.root / LATEST).exists():
            (self.root / LATEST).unlink()
            _fsync_path(self.root, directory=True)

    def _move_aside(self, paths: list[Path], why: str) -> None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for path in paths:
            aside = path.with_name(f"abandoned-{path.name}-{stamp}-{uuid.uuid4().hex[:4]}")
            log.warning("moving checkpoint %s aside to %s: %s", path, aside.name, why)
            os.rename(path, aside)
        _fsync_path(self.root, directory=True)

    def save(
        self,
        step: int,
        adapter: AdapterState | AdapterWriter,
        optimizer_state: Mapping[str, Any],
        trainer_state: TrainerState,
    ) -> CheckpointInfo:
        """Write checkpoint ``step-NNNNNN`` atomically, point ``latest`` at it, rotate old ones.

        Args:
            step: completed training steps, >= 0.
            adapter: an :class:`AdapterState` (tensors + config) or an :data:`AdapterWriter` callable.
            optimizer_state: ``optimizer.state_dict()`` (tensors, numbers, strings, containers only: it is read back
                with ``weights_only=True``).
            trainer_state: the JSON state (sampler, RNG, metric history, extra).

        Returns:
            :class:`CheckpointInfo` with the path, commit time, total bytes and save duration.

        Raises:
            ValueError / TypeError: bad arguments (nothing written).
            CheckpointSaveError: an I/O error (``errno`` set, ``ENOSPC`` for a full disk) or an adapter writer that
                failed or did not produce the PEFT files. Everything this call wrote is removed; earlier checkpoints
                and ``latest`` are untouched.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if not isinstance(trainer_state, TrainerState):
            raise TypeError(f"trainer_state must be a TrainerState, got {type(trainer_state).__name__}")
        if not isinstance(adapter, AdapterState) and not callable(adapter):
            raise TypeError(f"adapter must be an AdapterState or a callable writer, got {type(adapter).__name__}")
        if isinstance(adapter, AdapterState):
            bad = [k for k, v in adapter.tensors.items() if not isinstance(v, torch.Tensor)]
            if bad or not adapter.tensors:
                raise ValueError(f"adapter tensors must be a non-empty mapping of torch.Tensor; bad keys: {bad[:5]}")
        # Serialise the JSON parts first so that a non-serialisable value fails before anything touches the disk.
        state_bytes = _dump_json(trainer_state.to_json_dict(step), compact=True)

        started = time.monotonic()
        name = checkpoint_dir_name(step)
        final = self.root / name
        tmp = self.root / f"{_TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        committed = False
        replaced: Path | None = None
        try:
            _make_dirs(self.root)
            self._remove_stale_temporaries()
            tmp.mkdir()
            adapter_dir = tmp / ADAPTER_DIR
            adapter_dir.mkdir()
            self._write_adapter(adapter, adapter_dir)
            self._write_bytes(tmp / OPTIMIZER, _torch_save_bytes(optimizer_state))
            self._write_bytes(tmp / TRAINER_STATE, state_bytes)

            files = []
            total = 0
            for fpath in _files_under(tmp):
                sha, size = sha256_and_size(fpath, fsync=True)
                files.append({"path": fpath.relative_to(tmp).as_posix(), "bytes": size, "sha256": sha})
                total += size
            manifest = {"format": FORMAT, "step": step, "time": time.time(), "created": _utc_now_iso(),
                        "files": files}
            manifest_bytes = _dump_json(manifest)
            self._write_bytes(tmp / MANIFEST, manifest_bytes)
            _fsync_path(tmp / MANIFEST)
            total += len(manifest_bytes)
            for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: len(p.parts), reverse=True):
                _fsync_path(d, directory=True)

            replaced = self._set_aside_same_or_newer(step)
            os.rename(tmp, final)
            committed = True
            _fsync_path(self.root, directory=True)
            self._write_pointer(name)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if committed:
                # All or nothing: the pointer could not be replaced, so take the new directory back out.
                shutil.rmtree(final, ignore_errors=True)
            if replaced is not None and replaced.exists() and not final.exists():
                os.rename(replaced, final)  # put back the checkpoint this save was replacing
            try:
                _fsync_path(self.root, directory=True)
            except OSError:
                pass
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt / SystemExit: cleaned up, propagate unchanged
            raise self._save_error(step, e) from e
        commit_time = time.time()
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        try:
            self._rotate(keep_name=name)
        except OSError as e:  # committed: a failed clean-up must not turn a good checkpoint into a failed save
            log.warning("checkpoint %s saved, but removing old checkpoints (keep=%d) failed: %s", final, self.keep, e)
        info = CheckpointInfo(step=step, path=final, time=commit_time, bytes=total,
                              seconds=time.monotonic() - started)
        log.info("saved checkpoint %s (%d bytes in %.2f s)", final, info.bytes, info.seconds)
        return info

    # -- save helpers ------------------------------------------------------------------------------------------------

    def _write_bytes(self, path: Path, data: bytes) -> None:
        with self._open(path, "wb") as f:
            f.write(data)
            f.flush()

    def _write_adapter(self, adapter: AdapterState | AdapterWriter, adapter_dir: Path) -> None:
        if isinstance(adapter, AdapterState):
            tensors = {k: v.detach().cpu().contiguous() for k, v in adapter.tensors.items()}
            self._write_bytes(adapter_dir / ADAPTER_WEIGHTS,
                              safetensors.torch.save(tensors, metadata={"format": "pt"}))
            self._write_bytes(adapter_dir / ADAPTER_CONFIG, _dump_json(dict(adapter.config)))
        else:
            adapter(adapter_dir)
            missing = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (adapter_dir / n).is_file()]
            if missing:
                raise CheckpointError(f"adapter writer did not write {', '.join(missing)} into {adapter_dir} "
                                      f"(expected a PEFT adapter directory, e.g. PeftModel.save_pretrained)")

    def _write_pointer(self, name: str) -> None:
        tmp = self.root / f"{_TMP_PREFIX}{LATEST}-{uuid.uuid4().hex[:8]}"
        try:
            self._write_bytes(tmp, (name + "\n").encode("ascii"))
            _fsync_path(tmp)
            os.replace(tmp, self.root / LATEST)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            _fsync_path(self.root, directory=True)
        except OSError as e:  # the pointer is replaced: failing now would delete the directory it names
            log.warning("could not fsync %s after pointing %s at %s (%s): the pointer may not survive a power loss; "
                        "load_latest then still finds the newest checkpoint that verifies", self.root, LATEST, name, e)

    def _remove_stale_temporaries(self) -> None:
        """Remove what an interrupted save (``kill -9``) left behind, after putting back a replaced checkpoint that
        is the only copy of its step (:meth:`_restore_replaced`). Single writer per root assumed."""
        self._restore_replaced()
        for entry in self.root.iterdir():
            if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                log.info("removing leftover %s from an interrupted save", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _set_aside_same_or_newer(self, step: int) -> Path | None:
        """Checkpoints with a step >= ``step`` belong to another timeline (fresh start, explicit older resume, or a
        corrupt one we fell back from): rename them, never delete them, so ``resume: latest`` follows this run.

        Exception: saving again the step that ``latest`` names and that is the newest (the loop re-saved the same
        step) replaces it: the old directory goes to a ``.trash-*`` name, returned so the caller deletes it after
        the new one is committed (an interrupted save leaves it for the next save's clean-up)."""
        checkpoints = list_checkpoints(self.root)
        pointer = read_latest_pointer(self.root)
        replaced = None
        for other_step, path in checkpoints:
            if other_step == step and path.name == pointer and other_step == checkpoints[-1][0]:
                replaced = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
                log.info("saving step %d again: replacing %s", step, path)
                os.rename(path, replaced)
            elif other_step >= step:
                self._move_aside([path], f"it is at or after step {step} of the current run")
        return replaced

    def _rotate(self, keep_name: str) -> None:
        """Delete all but the newest ``keep`` checkpoints. ``keep_name`` (just saved, named by ``latest``) is the
        highest step, as :meth:`_set_aside_same_or_newer` moved anything newer away, so it is always kept."""
        checkpoints = list_checkpoints(self.root)
        excess = len(checkpoints) - self.keep
        for _, path in checkpoints:
            if excess <= 0:
                break
            if path.name == keep_name:  # cannot happen (see above); never delete what `latest` names
                continue
            try:
                _remove_tree(path)
                excess -= 1
                log.info("removed old checkpoint %s (keep=%d)", path, self.keep)
            except OSError as e:  # rotation failure must not fail a good save
                log.warning("could not remove old checkpoint %s: %s", path, e)

    def _save_error(self, step: int, e: BaseException) -> CheckpointSaveError:
        err = e.errno if isinstance(e, OSError) else None
        where = f"checkpoint {checkpoint_dir_name(step)} under {self.root}"
        if err == errno.ENOSPC:
            try:
                free = f"{shutil.disk_usage(self.root).free} bytes free"
            except OSError:
                free = "free space unknown"
            msg = (f"saving {where} failed: no space left on device ({free}); the partial checkpoint was removed "
                   f"and the previous checkpoint and '{LATEST}' pointer are unchanged")
        else:
            msg = (f"saving {where} failed: {type(e).__name__}: {e}; the partial checkpoint was removed and the "
                   f"previous checkpoint and '{LATEST}' pointer are unchanged")
        return CheckpointSaveError(msg, step=step, root=self.root, errno_=err)


# --------------------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------------------

CheckpointRef = Union[str, os.PathLike, LoadedCheckpoint, CheckpointInfo]


def restore_interrupted_export(dest: str | os.PathLike[str]) -> bool:
    """Put back the previous export at ``dest`` when an :func:`export_adapter` that was replacing it died (``kill
    -9``, node loss) between its two renames: it had moved the old adapter to ``.trash-<name>-<id>`` beside ``dest``
    and not yet renamed the new one in, which leaves no ``dest`` at all. Where ``dest`` is missing, the newest such
    sibling (by its weights file's modification time) that holds both :data:`ADAPTER_CONFIG` and
    :data:`ADAPTER_WEIGHTS` is renamed back to ``dest`` and the parent directory fsynced. Such a sibling was a
    complete export (it took ``dest``'s place by one rename); a partly deleted one lacks a required file and is
    skipped. Called by :func:`export_adapter` before it writes and by readers of an export
    (:func:`daedalus_trainer.evaluation.load_engine`).

    Returns:
        True when ``dest`` was put back, False when there was nothing to do (``dest`` exists, or no complete copy
        was found).

    Raises:
        OSError: the rename or the fsync failed.
    """
    dest = Path(dest).absolute()
    if dest.exists() or dest.is_symlink() or not dest.parent.is_dir():
        return False
    copies = [entry for entry in dest.parent.iterdir() if _trashed_name(entry) == dest.name
              and (entry / ADAPTER_CONFIG).is_file() and (entry / ADAPTER_WEIGHTS).is_file()]
    if not copies:
        return False
    newest = max(copies, key=lambda entry: ((entry / ADAPTER_WEIGHTS).stat().st_mtime_ns, entry.name))
    log.warning("restoring %s as %s: an export that was replacing it was interrupted before the new adapter was in "
                "place", newest.name, dest)
    os.rename(newest, dest)
    _fsync_path(dest.parent, directory=True)
    return True


def export_adapter(ckpt: CheckpointRef, dest: str | os.PathLike[str]) -> Path:
    """Copy a checkpoint's PEFT adapter to ``dest`` (conventionally ``<run>/exports/adapter``) atomically.

    The adapter files are verified against the checkpoint's manifest, copied into a temporary sibling of ``dest``,
    fsynced, verified again, and renamed into place; an existing ``dest`` is replaced (moved aside to
    ``.trash-<name>-<id>`` first, then deleted), so a reader sees either the old adapter or the new one, never a mix.
    A process killed between those two renames leaves no ``dest``: :func:`restore_interrupted_export` puts the old
    one back, and runs here first, before what an interrupted export left beside ``dest`` (``.tmp-<name>-*``,
    ``.trash-<name>-*``) is removed. One writer per ``dest`` assumed.

    Returns:
        ``dest`` as an absolute path.

    Raises:
        CheckpointCorruptError: the checkpoint's adapter files do not match its manifest.
        CheckpointError: the copy did not match (an I/O fault), or ``ckpt`` is not a checkpoint.
        OSError: writing ``dest`` failed (the previous ``dest`` is left in place), or reading the checkpoint failed
            for the file system's sake (:data:`READ_ERRNOS`, as :func:`verify_checkpoint`).
    """
    src = Path(ckpt.path if isinstance(ckpt, (LoadedCheckpoint, CheckpointInfo)) else ckpt).absolute()
    dest = Path(dest).absolute()
    restore_interrupted_export(dest)
    doc, problems = _read_manifest(src)
    if doc is None:
        raise CheckpointCorruptError(f"cannot export from {src}: " + "; ".join(map(str, problems)), {src: problems})
    entries = {e["path"]: e for e in doc["files"] if str(e.get("path", "")).startswith(ADAPTER_DIR + "/")}
    all_problems = [p for p in verify_checkpoint(src) if p.file.startswith(ADAPTER_DIR + "/")]
    if all_problems:
        raise CheckpointCorruptError(f"cannot export from {src}: " + "; ".join(map(str, all_problems)),
                                     {src: all_problems})

    _make_dirs(dest.parent)
    if dest.exists():  # leftovers of an interrupted export; never the only copy (dest is there)
        for entry in dest.parent.iterdir():
            if (entry.name.startswith((f"{_TMP_PREFIX}{dest.name}-", f"{_TRASH_PREFIX}{dest.name}-"))
                    and entry.is_dir() and not entry.is_symlink()):
                log.info("removing leftover %s of an interrupted export", entry)
                shutil.rmtree(entry, ignore_errors=True)
    tmp = dest.with_name(f"{_TMP_PREFIX}{dest.name}-{uuid.uuid4().hex[:8]}")
    old = dest.with_name(f"{_TRASH_PREFIX}{dest.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        for rel, entry in sorted(entries.items()):
            target = tmp / Path(rel).relative_to(ADAPTER_DIR)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, target)
            sha, size = sha256_and_size(target, fsync=True)
            if sha != entry["sha256"] or size != int(entry["bytes"]):
                raise CheckpointError(f"copy of {src / rel} to {target} does not match the manifest")
        for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: len(p.parts), reverse=True):
            _fsync_path(d, directory=True)
        if dest.exists():
            os.rename(dest, old)  # a kill from here to the next rename leaves only `old` (see above)
        os.rename(tmp, dest)
        _fsync_path(dest.parent, directory=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not dest.exists():
            os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)
    log.info("exported adapter of %s to %s", src, dest)
    return dest
