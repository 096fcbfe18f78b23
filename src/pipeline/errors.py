"""What a pipeline run can stop on, each with its exit status (docs/reliability.md).

Every error a user can cause or fix carries one message that names the file, the key and the
value and says what is valid or what to do; ``hedgecats pipeline`` prints it on one line, without
a traceback (``--debug`` or ``HEDGECATS_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import signal

from ..models.io import WriteFailedError

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_LOCKED",
    "ConfigError",
    "CorruptRunError",
    "Interrupted",
    "PipelineError",
    "ResumeRefusedError",
    "RunDirError",
    "RunLockedError",
    "StageFailedError",
    "WriteFailedError",
]

#: a stage or the evaluation failed (divergence, collapse, data, a failed write)
EXIT_FAILED = 1
#: a mistake in the pipeline, its overrides or the command line; nothing was trained
EXIT_CONFIG = 2
#: another pipeline holds the run directory
EXIT_LOCKED = 3


class PipelineError(Exception):
    """A failure with a message meant for the user; ``exit_code`` is the process's status."""

    exit_code = EXIT_FAILED


class ConfigError(PipelineError, ValueError):
    """The pipeline YAML, an override or a command-line value is invalid."""

    exit_code = EXIT_CONFIG


class RunDirError(PipelineError):
    """``--output`` cannot be used as a run directory (a file, not a run, not writable)."""

    exit_code = EXIT_CONFIG


class ResumeRefusedError(PipelineError):
    """A stage's checkpoint or result was produced by a config that differs from today's."""

    exit_code = EXIT_CONFIG


class CorruptRunError(PipelineError):
    """A file of the run directory cannot be read or does not match what vouches for it."""


class RunLockedError(PipelineError):
    """Another pipeline runs on the same directory."""

    exit_code = EXIT_LOCKED


class Interrupted(PipelineError):
    """SIGTERM or SIGINT: exit status 128 + the signal's number (143, 130)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StageFailedError(PipelineError):
    """A stage stopped on a non-finite loss or state, a divergence or a failed check; the
    message names the last good checkpoint and what to change."""
