"""The run directory: whose it is, who uses it now, and what each stage's ``done`` vouches for.

    <output>/hedgecats-run.json   marks a hedgecats run (pipeline name, source, creation time)
    <output>/pipeline.lock        the pipeline using the directory now (pid, host, start time)
    <output>/<stage>/done         JSON: the config that produced the stage and the size and
                                  sha256 of every file it wrote, and of the files it read from
                                  earlier stages; checked before the stage is skipped

Paths inside the run directory are recorded as ``${output}/...`` (``portable``), so a moved run
directory still compares equal, resumes and evaluates.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..models.io import atomic_write_text, file_digest, follow_umask
from .errors import CorruptRunError, RunDirError, RunLockedError

__all__ = ["DONE_FILE", "LOCK_FILE", "MARKER_FILE", "RunLock", "acquire_lock", "check_output",
           "is_rank_zero", "portable", "read_done", "run_id", "stage_outputs", "verify_done", "write_done",
           "write_marker"]

MARKER_FILE = "hedgecats-run.json"
LOCK_FILE = "pipeline.lock"
DONE_FILE = "done"
RUN_FORMAT, DONE_FORMAT = "hedgecats-run/1", "hedgecats-done/1"
#: what a stage directory holds besides its outputs
NOT_OUTPUTS = {"checkpoints", "logs", "superseded", DONE_FILE, "config.yaml"}


def is_rank_zero() -> bool:
    """False in the other processes of a multi-process launch (Lightning's launcher, torchrun,
    srun): only the first process locks and changes the run directory."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK", "GROUP_RANK"):
        with contextlib.suppress(ValueError):
            if int(os.environ.get(var, "0")) != 0:
                return False
    return True


def portable(obj, run_dir: str | Path):
    """``obj`` with every string that starts with ``run_dir`` rewritten as ``${output}/...``."""
    root = str(run_dir).rstrip("/")
    if isinstance(obj, dict):
        return {k: portable(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, root) for v in obj]
    if isinstance(obj, str) and (obj == root or obj.startswith(root + "/")):
        return "${output}" + obj[len(root):]
    return obj


# ----------------------------------------------------------------------------- whose directory
def check_output(out: Path, *, pipeline: str, stage_names: list[str], force: bool) -> None:
    """Refuse an ``--output`` that is a file, that cannot be created, or that is a non-empty
    directory which is not a hedgecats run (unless ``force``)."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--output {str(out)!r} is a file, not a directory; name a directory "
                          "(it is created when missing)")
    if not out.exists():
        parent = out.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise RunDirError(f"cannot create --output {str(out)!r}: {str(parent)!r} is not a "
                              "writable directory")
        return
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunDirError(f"--output {str(out)!r} is not writable")
    entries = sorted(p.name for p in out.iterdir())
    if not entries or force:
        return
    marker = out / MARKER_FILE
    if marker.exists():
        info = _read_json(marker, "run marker")
        if info.get("format") != RUN_FORMAT:
            raise CorruptRunError(f"{str(marker)!r} is not a hedgecats run marker (format "
                                  f"{info.get('format')!r}); restore it or pass --force")
        if info.get("pipeline") != pipeline:
            raise RunDirError(
                f"--output {str(out)!r} is a run of pipeline {info.get('pipeline')!r} "
                f"({info.get('source')}), not of {pipeline!r}; choose another --output, or pass "
                "--force to run this pipeline there (stages of the same name are then compared "
                "with their record)")
        return
    # a run made before the marker existed: only stage directories and the run's own files
    known = set(stage_names) | {"results.json", LOCK_FILE}
    foreign = [e for e in entries if e not in known and not e.startswith(".")]
    if foreign or not any((out / n).is_dir() for n in stage_names):
        raise RunDirError(
            f"--output {str(out)!r} is not empty and is not a hedgecats run (no {MARKER_FILE}; "
            f"it holds {', '.join(entries[:6])}{' ...' if len(entries) > 6 else ''}); choose "
            "another directory, or pass --force to use it anyway (files of the same names as "
            "the run's would be replaced)")


def write_marker(out: Path, *, pipeline: str, source: str) -> None:
    marker = out / MARKER_FILE
    if marker.exists():
        return
    from .. import __version__

    atomic_write_text(marker, json.dumps({
        "format": RUN_FORMAT, "pipeline": pipeline, "source": source,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hedgecats": __version__,
        "id": os.urandom(4).hex()}, indent=2))


def run_id(out: Path) -> str:
    """The run's id (W&B run names): the marker's, or ``new`` before the marker exists."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return str(json.loads((out / MARKER_FILE).read_text()).get("id") or "run")
    return "new"


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptRunError(f"{str(path)!r} cannot be read as a {what} ({err}); it is "
                              "damaged: restore it, or delete it (see docs/reliability.md)") from err
    if not isinstance(data, dict):
        raise CorruptRunError(f"{str(path)!r} is not a {what} (a JSON mapping expected); delete "
                              "it (see docs/reliability.md)")
    return data


# ----------------------------------------------------------------------------- the lock
def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), to tell a live holder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _process_start(pid)
    return start is None or now is None or now == start


@dataclass
class RunLock:
    path: Path
    token: str

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()


def acquire_lock(out: Path, command: str, warn=print) -> RunLock:
    """Take ``<out>/pipeline.lock`` or raise ``RunLockedError`` naming its holder; a lock left
    by a process of this host that no longer runs is taken over (``warn`` says so)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    pid, host = os.getpid(), socket.gethostname()
    token = f"{host}:{pid}:{time.time_ns()}"
    info = {"pid": pid, "host": host, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command, "pid_start": _process_start(pid), "token": token}
    tmp = out / f".{LOCK_FILE}.tmp-{pid}"
    tmp.write_text(json.dumps(info, indent=2))
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic: fails if the lock exists
                return RunLock(path, token)
            except FileExistsError:
                pass
            try:
                holder = json.loads(path.read_text())
                hpid = int(holder["pid"])
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise RunLockedError(
                    f"{str(path)!r} exists but cannot be read ({err}); if no pipeline runs on "
                    f"{str(out)!r}, delete it and run again") from err
            if holder.get("host") == host and not _alive(hpid, holder.get("pid_start")):
                stale = out / f".{LOCK_FILE}.stale-{hpid}"
                try:
                    os.replace(path, stale)  # only one of several takers wins the rename
                except FileNotFoundError:
                    continue
                stale.unlink(missing_ok=True)
                warn(f"warning: took over the lock of pid {hpid} (started {holder.get('started')}"
                     f"), which no longer runs: {holder.get('command')}")
                continue
            raise RunLockedError(
                f"{str(out)!r} is in use by another pipeline: pid {hpid} on {holder.get('host')}, "
                f"started {holder.get('started')} ({holder.get('command')}). Wait for it to "
                f"finish or stop it; if it is gone (e.g. on another host), delete {str(path)!r}")
        raise RunLockedError(f"could not take {str(path)!r}: it keeps changing; is another "
                             "pipeline starting on the same directory?")
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- done
def stage_outputs(stage_dir: Path) -> list[Path]:
    """Every file a stage wrote besides its checkpoints, logs, ``done`` and ``config.yaml``."""
    files = []
    for p in sorted(stage_dir.rglob("*")):
        rel = p.relative_to(stage_dir)
        if rel.parts[0] in NOT_OUTPUTS or any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file():
            files.append(p)
    return files


def _describe_files(paths: list[Path], root: Path) -> dict[str, dict]:
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": file_digest(p)}
            for p in paths}


def write_done(stage_dir: Path, *, fit: dict, inputs: dict[str, str], extra: dict | None = None
               ) -> dict:
    """Write ``done``: the (portable) config, the inputs' digests, every output's size and
    sha256. The outputs are first given the umask's modes (safetensors writes 0600)."""
    for p in stage_outputs(stage_dir):
        follow_umask(p)
    record = {"format": DONE_FORMAT, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "files": _describe_files(stage_outputs(stage_dir), stage_dir),
              "inputs": inputs, "fit": fit, **(extra or {})}
    atomic_write_text(stage_dir / DONE_FILE, json.dumps(record, indent=1, default=str))
    return record


def read_done(stage_dir: Path) -> dict | None:
    """The ``done`` record, ``{"legacy": True}`` for the timestamp an older hedgecats wrote, or
    ``None`` when the stage has not finished."""
    path = stage_dir / DONE_FILE
    if not path.exists():
        return None
    text = path.read_text(errors="replace").strip()
    if text and not text.startswith("{"):
        return {"legacy": True, "finished": text}
    record = _read_json(path, "stage's done record")
    if record.get("format") != DONE_FORMAT or not isinstance(record.get("files"), dict):
        raise CorruptRunError(f"{str(path)!r} is not a hedgecats done record (format "
                              f"{record.get('format')!r}); delete it so that the stage is checked "
                              "again from its checkpoint")
    return record


def verify_done(stage_dir: Path, record: dict) -> list[str]:
    """What no longer matches ``done``: missing, resized or changed files (empty: all good)."""
    problems = []
    for rel, want in sorted(record["files"].items()):
        p = stage_dir / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = p.stat().st_size
        if size != want.get("size"):
            problems.append(f"{rel} has {size} bytes, done recorded {want.get('size')}")
        elif file_digest(p) != want.get("sha256"):
            problems.append(f"{rel} changed since the stage finished (sha256 differs)")
    return problems
