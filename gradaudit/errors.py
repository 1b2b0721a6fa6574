"""Exit codes and the error hierarchy.

Every error class carries the exit code it maps to, so the CLI translates an
exception into a process status in exactly one place
(:func:`gradaudit.cli.app.exit_codes`) and the core never calls ``sys.exit``. A
result's exit code is decided in one place too: :mod:`gradaudit.results.verdict`.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradaudit.results.location import Location


class ExitCode(IntEnum):
    """The process status contract CI pipelines rely on."""

    #: Every input was audited and no finding is configured to fail the run.
    OK = 0
    #: Every input was audited and at least one finding fails the run
    #: (by default: NaN, Inf or an exploding norm).
    FINDINGS = 1
    #: The command line was wrong: unknown option, bad value, unavailable device.
    USAGE_ERROR = 2
    #: An input could not be audited: missing, unreadable, corrupt, unsupported,
    #: or nothing floating-point to audit. Beats FINDINGS: a partial audit never passes.
    INPUT_ERROR = 3
    #: A bug in gradaudit. The CLI prints one line and suggests ``--debug``.
    INTERNAL_ERROR = 4
    #: The report or a message could not be written: stdout or stderr closed, full
    #: or failing. Beats every verdict (a lost report must not read as a pass, nor
    #: as findings); a reader that stopped early (``| head``) is not a failure.
    #: Click and Typer use 1, 2 and 130; 5 is free.
    OUTPUT_ERROR = 5


class GradauditError(Exception):
    """Base of every error gradaudit raises on purpose."""

    exit_code: ExitCode = ExitCode.INTERNAL_ERROR


class UsageError(GradauditError):
    """An option or argument that cannot be honoured (e.g. ``--device cuda`` without CUDA)."""

    exit_code = ExitCode.USAGE_ERROR


class InputError(GradauditError):
    """An input that cannot be audited; the message names the file and the cause."""

    exit_code = ExitCode.INPUT_ERROR

    def __init__(self, path: str | Path | None, cause: str) -> None:
        self.path = None if path is None else str(path)
        self.cause = cause
        super().__init__(cause if self.path is None else f"{self.path}: {cause}")


#: Exceptions that say gradaudit's own code cannot run, whatever the bytes it reads: an
#: assertion of its own, a name or import that does not resolve, a branch left unwritten.
#: Met while reading an input, they are still a defect (exit 4), never the file's fault.
CODE_DEFECTS: tuple[type[Exception], ...] = (
    AssertionError,
    NameError,
    ImportError,
    NotImplementedError,
    SyntaxError,
    SystemError,
)


class MalformedInput(InputError):
    """A reader met an exception it does not check for by name while turning an input's
    data into tensors (``'int' object is not iterable`` from a field that should hold a
    list): the input's error, exit code 3, never the run's.

    Readers validate what they know a file declares; this is the boundary behind them, so
    that a value nobody thought of costs that input, not the report of the others.
    """

    def __init__(self, path: str | Path | None, error: BaseException) -> None:
        if isinstance(error, MemoryError):
            cause = "not enough memory to read it"
        else:
            detail = " ".join(str(error).split())[:160]
            cause = (
                f"malformed: reading it raised {type(error).__name__}"
                f"{': ' + detail if detail else ''} (a value gradaudit does not check for; "
                "--debug shows where)"
            )
        super().__init__(path, cause)
        self.error = error


def is_code_defect(error: BaseException) -> bool:
    """Whether ``error`` is gradaudit's own defect wherever it was raised (see CODE_DEFECTS)."""
    return isinstance(error, CODE_DEFECTS) and not isinstance(error, GradauditError)


class OutputError(GradauditError):
    """The report could not be written where it was going (stdout closed or full)."""

    exit_code = ExitCode.OUTPUT_ERROR


class NonFiniteGradientError(GradauditError):
    """A :class:`~gradaudit.GradientMonitor` found NaN or Inf gradients and was told to raise.

    Carries the step whose stats showed them, the tensors' names, the dump
    written (or ``None``) and, with ``locate=``, where the NaN/Inf came from
    (:class:`~gradaudit.Location`, also in the message; ``None`` when the monitor does not
    locate or the step could not be located), so a training script can log them and stop
    cleanly.
    """

    exit_code = ExitCode.FINDINGS

    def __init__(
        self,
        step: int,
        tensors: tuple[str, ...],
        dump: Path | None,
        message: str,
        location: Location | None = None,
    ) -> None:
        self.step = step
        self.tensors = tensors
        self.dump = dump
        self.location = location
        super().__init__(message)


class KernelCompileWarning(RuntimeWarning):
    """The background compile of the Triton kernels failed (once per GPU architecture and
    process): ``auto`` goes on with the eager kernel, and compiles in the process only
    once ``COMPILE_AFTER_BYTES`` went through it, as it did before the background compile."""


class NonFiniteGradientWarning(RuntimeWarning):
    """Issued by a :class:`~gradaudit.GradientMonitor` that found NaN or Inf gradients."""


class GradientFindingError(GradauditError):
    """A :class:`~gradaudit.GradientMonitor` told to raise (``on_finding="raise"``) found a
    failing finding other than NaN/Inf (``exploding`` by default: ``Thresholds.fail_on``).

    Carries the step, the findings' ``(kind, tensor)`` pairs and the dump written (or
    ``None``), like :class:`NonFiniteGradientError`.
    """

    exit_code = ExitCode.FINDINGS

    def __init__(
        self,
        step: int,
        findings: tuple[tuple[str, str], ...],
        dump: Path | None,
        message: str,
    ) -> None:
        self.step = step
        self.findings = findings
        self.dump = dump
        super().__init__(message)


class GradientFindingWarning(RuntimeWarning):
    """Issued by a :class:`~gradaudit.GradientMonitor` whose collected step has new exploding,
    vanishing or outlier gradients (``on_finding="warn"``, the default)."""


class ReplicaDivergenceError(GradauditError):
    """A :class:`~gradaudit.GradientMonitor` told to raise (``on_divergence="raise"``) found
    a replicated (DDP) gradient that is not bit-identical on every rank.

    Carries the step, the first differing tensor, the ranks that differ from the reference
    (the ranks most of which agree), every differing tensor and this rank's dump (or
    ``None``). Every rank sees the same gathered digests, so every rank raises together.
    """

    exit_code = ExitCode.FINDINGS

    def __init__(
        self,
        step: int,
        tensor: str,
        ranks: tuple[int, ...],
        tensors: tuple[str, ...],
        dump: Path | None,
        message: str,
    ) -> None:
        self.step = step
        self.tensor = tensor
        self.ranks = ranks
        self.tensors = tensors
        self.dump = dump
        super().__init__(message)


class ReplicaDivergenceWarning(RuntimeWarning):
    """Issued by a :class:`~gradaudit.GradientMonitor` whose DDP replicas' gradients differ
    across ranks (``on_divergence="dump"`` or ``"warn"``)."""
