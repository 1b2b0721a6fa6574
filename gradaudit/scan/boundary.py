"""The per-input boundary: whatever goes wrong while one input is read costs that input,
never the report of the others.

Readers validate what a file declares (sizes, types, offsets) and raise
:class:`~gradaudit.errors.InputError` naming the cause. Behind them sit two rules:

* An exception raised *by a reader* (opening the input, walking its items, loading a
  piece, checking it did not change) that no reader anticipated is the input's error,
  :class:`~gradaudit.errors.MalformedInput` (exit code 3): hostile-but-loadable data met a
  case nobody checked for by name. Only exceptions that say gradaudit's own code cannot
  run (:data:`~gradaudit.errors.CODE_DEFECTS`) are never blamed on the file.
* Any other exception while the input is audited — the engine failing on tensors a reader
  validated, or a code defect in a reader — is a defect in gradaudit: the input is recorded
  with ``internal=True`` (exit code 4) and the other inputs are still audited and reported.

Pure Python, no torch: the torch-free scan uses it too.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from gradaudit.errors import GradauditError, InputError, MalformedInput, is_code_defect
from gradaudit.results import InputProblem

__all__ = ["guarded", "problem_of", "reading"]

T = TypeVar("T")


@contextmanager
def reading(path: str) -> Iterator[None]:
    """Run a reader's call: an exception it did not anticipate becomes ``path``'s error."""
    try:
        yield
    except GradauditError:
        raise
    except Exception as error:  # the boundary: see the module docstring
        if is_code_defect(error):
            raise
        raise MalformedInput(path, error) from error


def guarded(path: str, items: Iterable[T]) -> Iterator[T]:
    """``items`` (a reader's lazy iterator), each step of it read under :func:`reading`.

    A plain ``try`` per item rather than a context manager: a pickle of a million tiny
    tensors yields a million items, and an unraised ``try`` costs nothing.
    """
    iterator = iter(items)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except GradauditError:
            raise
        except Exception as error:  # the boundary: see the module docstring
            if is_code_defect(error):
                raise
            raise MalformedInput(path, error) from error
        yield item


def problem_of(path: str, error: Exception) -> InputProblem:
    """The :class:`InputProblem` an exception that ended ``path``'s audit stands for.

    An :class:`InputError` is the file's (exit 3); a :class:`MalformedInput` keeps the
    traceback of what the reader raised. Not enough memory is the input's too (it
    declares more than this machine holds). Anything else is gradaudit's defect (exit 4).
    """
    if isinstance(error, MalformedInput):
        return InputProblem(path, error.cause, traceback=_trace(error.error))
    if isinstance(error, InputError):
        return InputProblem(path, error.cause)
    if isinstance(error, MemoryError):
        return InputProblem(path, "not enough memory to audit it", traceback=_trace(error))
    detail = " ".join(str(error).split())[:200]
    return InputProblem(
        path,
        f"{type(error).__name__}"
        f"{': ' + detail if detail else ''} (this is a bug in gradaudit, not a problem of "
        "the file; rerun with --debug for the traceback and report it)",
        internal=True,
        traceback=_trace(error),
    )


def _trace(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))
