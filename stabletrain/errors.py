"""The one error a user's mistake raises: a config value, a data file or a checkpoint that
cannot run. Its message is one line naming the problem and the fix; the command line prints
it as ``error: ...`` and exits 2, with no traceback (:func:`fail`). Also the warning a loop of
one's own gets where a fix finds nothing to act on (:class:`ReachedNothing`)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


class ConfigError(ValueError):
    """A value that cannot run; the message is one line naming the key and the fix."""


class ReachedNothing(UserWarning):
    """A fix found no layer of the model to act on (sigmaReparam and no linear layer, LocAteR and
    no fused qkv attention): warned to a loop of one's own; train.py's start notes say it instead."""


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C ended training mid-step, without a checkpoint; the message says at which
    step and which step last.pt holds (``saved_step``, None when there is none)."""

    def __init__(self, reason: str, saved_step: int | None = None):
        super().__init__(reason)
        self.saved_step = saved_step


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty),
    for one-line reports of errors raised by other libraries."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def fail(msg: str, code: int = 2, every_rank: bool = False) -> None:
    """Print ``error: msg`` and exit with ``code``. A config mistake is the same on every rank of
    a job: only rank 0 prints it (``every_rank`` for what one rank alone may know)."""
    from stabletrain.topology import detect

    info = detect()
    if every_rank or info.rank == 0:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" and sys.exc_info()[0] is not None:
            traceback.print_exc()  # Hydra's switch for the whole story: where the one line came from
        line = f"error: {f'rank {info.rank}: ' if every_rank and info.enabled else ''}{msg}"
        print(line, file=sys.stderr)
        _tell_torchrun(line)
    sys.exit(code)


def _tell_torchrun(line: str) -> None:
    """torchrun ends a failed job with its own report, whose "Root Cause" shows the worker's
    error file (else a link to its docs): put the one line there, where the eye lands last."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass
