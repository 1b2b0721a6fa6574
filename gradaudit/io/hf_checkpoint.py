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
* ``trainer_state.json``'s ``log_history`` (the Trainer's logged ``loss`` and its
  pre-clipping ``grad_norm``) is judged by :mod:`gradaudit.scan.history` (NaN, Inf, a
  blow-up, with the step) and summarised in one skipped entry beside the report: a
  checkpoint holds weights and optimizer moments, not gradients, and a run that diverged
  can leave every tensor finite while its log says what happened.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Pieces, Select, SourceItem
from gradaudit.io.files import show
from gradaudit.io.layouts import MODEL_FILES as MODEL_FILES
from gradaudit.io.layouts import TRAINER_STATE as TRAINER_STATE
from gradaudit.io.layouts import is_file
from gradaudit.io.layouts import is_trainer_checkpoint as is_trainer_checkpoint
from gradaudit.io.safetensors_source import SafetensorsSource
from gradaudit.io.sharded import ShardedSource
from gradaudit.io.torch_pickle import TorchPickleSource
from gradaudit.io.trainer_state import read_log_history
from gradaudit.policy import Role
from gradaudit.results import Skipped
from gradaudit.results.roles import TensorHint

OPTIMIZER_FILE = "optimizer.pt"
_MODEL_EVIDENCE = "the model file of a Trainer checkpoint"
#: The optimizer's tensors are named under this prefix.
OPTIMIZER_PREFIX = "optimizer."

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
    try:
        rows = read_log_history(os.path.join(directory, TRAINER_STATE))
    except InputError as error:
        raise InputError(directory, error.cause) from None
    return [(row.step, row.grad_norm) for row in rows if row.grad_norm is not None]


class TrainerCheckpointSource:
    """A ``transformers`` Trainer checkpoint directory: model, optimizer, logged norms."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.model_file = next(
            (n for n in MODEL_FILES if is_file(os.path.join(path, n))), MODEL_FILES[1]
        )
        try:
            #: The Trainer's logged history, judged by :mod:`gradaudit.scan.history`.
            self.logged_history = read_log_history(os.path.join(path, TRAINER_STATE))
        except InputError as error:
            raise InputError(path, error.cause) from None
        try:
            names = sorted(os.listdir(path))
        except OSError as error:
            raise InputError(path, f"cannot list the directory: {error.strerror}") from None
        self.others = [n for n in names if is_file(os.path.join(path, n))]
        #: What the files inside say each tensor is, under the directory's names: the model
        #: file's tensors are weights, the optimizer's keep their optimizer-state roles and
        #: gradient-estimate bases (filled while :meth:`items` runs, as readers do).
        self.role_hints: dict[str, TensorHint] = {}
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

    def _hint(self, source: object, name: str, prefix: str, model: bool) -> None:
        """Carry what an inner file says of ``name`` over to the directory's name for it."""
        inner = getattr(source, "role_hints", None)
        hint = inner.get(name) if isinstance(inner, dict) else None
        if hint is not None:
            aux_for = None if hint.aux_for is None else prefix + hint.aux_for
            self.role_hints[prefix + name] = dataclasses.replace(hint, aux_for=aux_for)
        elif model:
            self.role_hints[prefix + name] = TensorHint(Role.WEIGHT, _MODEL_EVIDENCE)

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
            model = name == self.model_file
            for item in source.items(inner if select is not None else None):
                if isinstance(item, Excluded):
                    yield Excluded(prefix + item.name)
                elif isinstance(item, Skipped):
                    yield dataclasses.replace(item, name=prefix + item.name, source=self.path)
                elif isinstance(item, Pieces):
                    self._hint(source, item.name, prefix, model)
                    yield Pieces(prefix + item.name, item.shape, item.dtype, item.load)
                else:
                    self._hint(source, item[0], prefix, model)
                    yield prefix + item[0], item[1]
        except InputError as error:
            raise InputError(self.path, f"{show(name)}: {error.cause}") from None
