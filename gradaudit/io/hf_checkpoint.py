"""A Hugging Face Trainer checkpoint directory (``checkpoint-500/``) read as one checkpoint.

``Trainer.save_model`` and its checkpoints write a directory: the model
(``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``),
``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``training_args.bin`` and
``trainer_state.json``. Scanned file by file, ``training_args.bin`` (a pickled
``TrainingArguments`` object) is rightly refused as unsafe and fails the run. Read as one
checkpoint:

* the model's tensors keep their names; the optimizer's state is ``optimizer.state.<i>.<key>``.
  The Trainer builds its optimizer from parameter lists in two groups (with and without
  weight decay) and saves no parameter names, so state index ``i`` is tied to a parameter
  only when :mod:`gradaudit.io.nested`'s rules allow it without guessing (they do not for
  the usual two groups): no name is better than a plausible wrong one;
* ``scheduler.pt``, ``rng_state*.pth`` and ``training_args.bin`` are listed as skipped and
  never opened: bookkeeping, not tensors to audit, and the last is code;
* ``trainer_state.json``'s ``log_history`` gradient norms (the Trainer's own, taken before
  clipping) are summarised in one skipped entry beside the report, and returned in full by
  :func:`trainer_grad_norms`: a checkpoint holds weights and optimizer moments, not
  gradients, so the logged norms are the gradient record to read next to them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Pieces, Select, SourceItem
from gradaudit.io.files import open_checked, show
from gradaudit.io.layouts import MODEL_FILES as MODEL_FILES
from gradaudit.io.layouts import TRAINER_STATE as TRAINER_STATE
from gradaudit.io.layouts import is_file
from gradaudit.io.layouts import is_trainer_checkpoint as is_trainer_checkpoint
from gradaudit.io.safetensors_source import SafetensorsSource
from gradaudit.io.sharded import ShardedSource
from gradaudit.io.torch_pickle import TorchPickleSource
from gradaudit.results import Skipped

OPTIMIZER_FILE = "optimizer.pt"
#: The optimizer's tensors are named under this prefix.
OPTIMIZER_PREFIX = "optimizer."
#: A ``trainer_state.json`` larger than this is not read (a long run's is a few MB).
MAX_STATE_BYTES = 64 << 20

_NOT_READ = {
    "scheduler.pt": "learning-rate scheduler state, not tensors to audit; not read",
    "training_args.bin": "pickled TrainingArguments (an object, not tensors); never unpickled",
    "scaler.pt": "mixed-precision loss-scaler state; not read",
}


def trainer_grad_norms(directory: str) -> list[tuple[int, float]]:
    """``(step, grad_norm)`` of every ``log_history`` row that has one; raises InputError.

    The Trainer logs the norm of the gradients before it clips them (``max_grad_norm``);
    a non-finite norm is kept as logged (``nan``/``inf``).
    """
    path = os.path.join(directory, TRAINER_STATE)
    handle, size = open_checked(path)
    with handle:
        if size > MAX_STATE_BYTES:
            raise InputError(directory, f"{TRAINER_STATE} is {size} bytes, absurdly large")
        raw = handle.read(MAX_STATE_BYTES + 1)
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InputError(directory, f"{TRAINER_STATE} is not valid JSON") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise InputError(directory, f"{TRAINER_STATE} has no log_history list")
    norms = []
    for row in history:
        if not isinstance(row, dict):
            continue
        step, norm = row.get("step"), row.get("grad_norm")
        if type(step) is int and isinstance(norm, int | float) and not isinstance(norm, bool):
            norms.append((step, float(norm)))
    return norms


def _norms_note(norms: list[tuple[int, float]]) -> str:
    if not norms:
        return "Trainer log_history has no grad_norm; nothing to show beside the report"
    step, last = norms[-1]
    finite = [(n, s) for s, n in norms if math.isfinite(n)]
    bad = [s for s, n in norms if not math.isfinite(n)]
    text = f"the Trainer logged grad_norm {last:.4g} at step {step} (before clipping)"
    if finite:
        peak, at = max(finite)
        text += f"; {len(norms)} logged, largest {peak:.4g} at step {at}"
    if bad:
        text += f"; non-finite at step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))}"
    return text


class TrainerCheckpointSource:
    """A ``transformers`` Trainer checkpoint directory: model, optimizer, logged norms."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.model_file = next(
            (n for n in MODEL_FILES if is_file(os.path.join(path, n))), MODEL_FILES[1]
        )
        self.grad_norms = trainer_grad_norms(path)
        try:
            names = sorted(os.listdir(path))
        except OSError as error:
            raise InputError(path, f"cannot list the directory: {error.strerror}") from None
        self.others = [n for n in names if is_file(os.path.join(path, n))]
        #: The file readers opened so far, by file name (for :meth:`check_unchanged`).
        self._opened: list[tuple[str, SafetensorsSource | ShardedSource | TorchPickleSource]] = []

    def _model(self) -> SafetensorsSource | ShardedSource | TorchPickleSource:
        full = os.path.join(self.path, self.model_file)
        if self.model_file.endswith(".index.json"):
            return ShardedSource(full)
        if self.model_file.endswith(".safetensors"):
            return SafetensorsSource(full)
        return TorchPickleSource(full)

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        # First, so it stands at the top of the skipped list, beside the report.
        yield Skipped(TRAINER_STATE, _norms_note(self.grad_norms), self.path)
        yield from self._file(self.model_file, "", select)
        if OPTIMIZER_FILE in self.others:
            yield from self._file(OPTIMIZER_FILE, OPTIMIZER_PREFIX, select)
        for name in self.others:
            reason = _NOT_READ.get(name)
            if reason is None and name.startswith("rng_state") and name.endswith(".pth"):
                reason = "random-number-generator state, not tensors to audit; not read"
            if reason is not None:
                yield Skipped(name, reason, self.path)

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if a file of the checkpoint changed while it was read."""
        for name, source in self._opened:
            try:
                source.check_unchanged()
            except InputError as error:
                raise InputError(self.path, f"{show(name)}: {error.cause}") from None

    def _file(self, name: str, prefix: str, select: Select | None) -> Iterator[SourceItem]:
        def inner(tensor_name: str) -> bool:
            return select is None or select(prefix + tensor_name)

        try:
            source = (
                self._model()
                if name == self.model_file
                else TorchPickleSource(os.path.join(self.path, name))
            )
            self._opened.append((name, source))
            for item in source.items(inner if select is not None else None):
                if isinstance(item, Excluded):
                    yield Excluded(prefix + item.name)
                elif isinstance(item, Skipped):
                    yield dataclasses.replace(item, name=prefix + item.name, source=self.path)
                elif isinstance(item, Pieces):
                    yield Pieces(prefix + item.name, item.shape, item.dtype, item.load)
                else:
                    yield prefix + item[0], item[1]
        except InputError as error:
            raise InputError(self.path, f"{show(name)}: {error.cause}") from None
