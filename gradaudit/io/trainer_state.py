"""``trainer_state.json``: the history a ``transformers.Trainer`` logged, read safely.

The Trainer writes its log rows (``loss``, the pre-clipping ``grad_norm``,
``learning_rate``, ``epoch``) into ``log_history`` at every logging step and saves the
file with each checkpoint. It is plain JSON, so reading it runs nothing; a hostile one is
capped in size and every value is checked for its type. :mod:`gradaudit.scan.history`
judges the rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradaudit.errors import InputError
from gradaudit.io.files import open_checked, plain_number
from gradaudit.io.layouts import TRAINER_STATE

if TYPE_CHECKING:  # the scan's torch-free host side imports LoggedStep from here
    from gradaudit.io.base import Select, SourceItem
#: A ``trainer_state.json`` larger than this is not read (a long run's is a few MB).
MAX_STATE_BYTES = 64 << 20


@dataclass(frozen=True)
class LoggedStep:
    """One row of a trainer's log: the step and what was logged there (``None``: not logged)."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None


def read_log_history(path: str) -> tuple[LoggedStep, ...]:
    """The logged rows of the ``trainer_state.json`` at ``path``; raises InputError."""
    handle, size = open_checked(path)
    with handle:
        if size > MAX_STATE_BYTES:
            raise InputError(path, f"{TRAINER_STATE} is {size} bytes, absurdly large")
        raw = handle.read(MAX_STATE_BYTES + 1)
    try:
        state = json.loads(raw.decode("utf-8-sig"))  # a BOM some editors write is no error
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InputError(path, f"{TRAINER_STATE} is not valid JSON") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise InputError(path, f"{TRAINER_STATE} has no log_history list")
    return logged_steps(history)


def logged_steps(history: Iterable[object]) -> tuple[LoggedStep, ...]:
    """The ``(step, loss, grad_norm)`` rows of a ``log_history`` list, in its order.

    Rows without an integer step, or with neither number, are left out; a value that is
    not a plain number (text, ``bool``, an integer too large for a float) counts as not
    logged. NaN and Inf stay as logged: they are what the history is read for.
    """
    rows = []
    for row in history:
        if not isinstance(row, dict):
            continue
        step = row.get("step")
        if type(step) is not int:
            continue
        loss, norm = plain_number(row.get("loss")), plain_number(row.get("grad_norm"))
        if loss is None and norm is None:
            continue
        rows.append(LoggedStep(step, loss, norm))
    return tuple(rows)


def describe_history(rows: tuple[LoggedStep, ...]) -> str:
    """One line on what was logged, for the skipped list beside the report."""
    norms = [(row.step, row.grad_norm) for row in rows if row.grad_norm is not None]
    losses = [(row.step, row.loss) for row in rows if row.loss is not None]
    if not norms and not losses:
        return "the trainer's log_history has no loss or grad_norm; nothing judged"
    parts = []
    for key, values in (("loss", losses), ("grad_norm", norms)):
        if values:
            step, last = values[-1]
            parts.append(f"{key} {last:.4g} at step {step}")
    text = f"{len(rows)} logged steps judged (last: {', '.join(parts)})"
    if norms:
        text += "; grad_norm is the trainer's, before clipping"
    return text


class TrainerStateSource:
    """A ``trainer_state.json`` on its own: no tensors, only the logged history to judge."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: Read by the scan and judged by :mod:`gradaudit.scan.history`.
        self.logged_history = read_log_history(path)

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        return iter(())  # no tensors: the history is read by the scan (``logged_history``)

    def check_unchanged(self) -> None:
        """Nothing to check: the file was read whole before any work."""
