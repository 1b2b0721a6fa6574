"""What each audited tensor *is* (its :class:`~gradaudit.policy.Role`), and why we think so.

A norm of 190 is an exploding gradient and a perfectly healthy embedding matrix; a second
moment of 1e-8 is a healthy Adam state and a vanishing gradient. The checks that apply
depend on the role, so the role is decided first, from the strongest evidence there is,
and the evidence is recorded with it (``role_evidence`` in every output):

1. ``--kind gradients|weights`` (:class:`~gradaudit.policy.InputKind`): the user says what
   the files hold. Optimizer state and buffers found by structure or name keep their role.
2. The structure of a checkpoint, seen by the reader that walked it (a
   :class:`TensorHint` per tensor): a ``torch.optim`` state dict's per-parameter keys
   (``exp_avg`` …, see :data:`OPTIMIZER_STATE_ROLES`), the model or EMA state dict beside
   it, containers named like ``model`` / ``state_dict`` / ``ema`` / ``grads``.
3. Names: ``….grad``, BatchNorm's ``running_mean`` and the like (:func:`role_from_name`).
4. The file's metadata (:func:`metadata_evidence`): gradaudit's own dumps say they hold
   gradients; ``format: pt`` without that is what ``transformers`` writes for weights.
5. For a flat file with nothing else, the stats themselves (:func:`stats_evidence`):
   normalisation-layer weights have an RMS near 1, no zeros and no spikes, which gradients
   almost never have. Measured reliability is in ``docs/roles.md``; the summary says when
   this (or the plain default, gradients) decided, so a thin call is never silent.

Readers pass what they know through two optional attributes (see
:class:`gradaudit.io.base.TensorSource`): ``role_hints`` (tensor name -> :class:`TensorHint`,
filled while :meth:`items` runs) and ``metadata`` (the file's string metadata).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from gradaudit.policy import InputKind, Role
from gradaudit.results import TensorStats

# The hint types live in results/ (readers import them); re-exported for the documented
# gradaudit.roles.TensorHint.
from gradaudit.results.roles import EstimateBasis as EstimateBasis
from gradaudit.results.roles import FileEvidence as FileEvidence
from gradaudit.results.roles import TensorHint as TensorHint
from gradaudit.results.stats_table import StatsTable

#: ``torch.optim`` per-parameter state keys (and those of common third-party optimizers).
OPTIMIZER_STATE_ROLES: Mapping[str, Role] = {
    "exp_avg": Role.OPTIMIZER_MOMENT,  # Adam, AdamW, NAdam, RAdam, Lion
    "momentum_buffer": Role.OPTIMIZER_MOMENT,  # SGD, RMSprop(momentum)
    "grad_avg": Role.OPTIMIZER_MOMENT,  # RMSprop(centered)
    "exp_avg_sq": Role.OPTIMIZER_SECOND_MOMENT,  # Adam family
    "max_exp_avg_sq": Role.OPTIMIZER_SECOND_MOMENT,  # amsgrad
    "square_avg": Role.OPTIMIZER_SECOND_MOMENT,  # RMSprop, Adadelta
    "acc_delta": Role.OPTIMIZER_SECOND_MOMENT,  # Adadelta
    "sum": Role.OPTIMIZER_SECOND_MOMENT,  # Adagrad
    "exp_inf": Role.OPTIMIZER_SECOND_MOMENT,  # Adamax (max of |g|, never negative)
    "row_var": Role.OPTIMIZER_SECOND_MOMENT,  # torch.optim.Adafactor, factored
    "col_var": Role.OPTIMIZER_SECOND_MOMENT,
    "variance": Role.OPTIMIZER_SECOND_MOMENT,
    "exp_avg_sq_row": Role.OPTIMIZER_SECOND_MOMENT,  # transformers/timm Adafactor
    "exp_avg_sq_col": Role.OPTIMIZER_SECOND_MOMENT,
    "prev": Role.GRADIENT,  # Rprop: the previous gradient
    "ax": Role.WEIGHT,  # ASGD: the averaged parameters
}

#: Containers whose tensors are model weights (a path component, compared in lower case).
WEIGHT_CONTAINERS = frozenset(
    {
        "model",
        "models",
        "state_dict",
        "model_state_dict",
        "module",
        "net",
        "network",
        "ema",
        "model_ema",
        "ema_model",
        "ema_state_dict",
        "shadow",
        "shadow_params",
        "averaged_model",
        "params",
        "weights",
    }
)
#: Containers whose tensors are gradients.
GRADIENT_CONTAINERS = frozenset({"grad", "grads", "gradients"})

#: Last name components of module buffers: state, not trained weights.
BUFFER_NAMES = frozenset(
    {
        "running_mean",
        "running_var",
        "num_batches_tracked",
        "inv_freq",
        "position_ids",
        "token_type_ids",
        "relative_position_index",
        "masked_bias",
        "cos_cached",
        "sin_cached",
    }
)

_COMPONENTS = re.compile(r"[./]")


def _components(name: str) -> list[str]:
    # A parenthesised parameter (``optimizer.state.3.exp_avg (encoder.weight)``) is not
    # part of the path.
    path = name.split(" (", 1)[0]
    return [c.lower() for c in _COMPONENTS.split(path) if c]


def role_from_name(name: str) -> tuple[Role, str] | None:
    """The role a tensor's name alone gives (buffers, ``.grad``), or None."""
    parts = _components(name)
    if not parts:
        return None
    if parts[-1] in BUFFER_NAMES:
        return Role.BUFFER, f"name ends in {parts[-1]!r}, a module buffer"
    if parts[-1] == "grad" or any(p in GRADIENT_CONTAINERS for p in parts[:-1]):
        return Role.GRADIENT, "name says gradient (.grad / grads)"
    return None


def container_hint(name: str) -> TensorHint | None:
    """A role from a container the tensor sits in (``model.…``, ``ema.…``, ``grads.…``)."""
    parts = _components(name)[:-1]
    for part in parts:
        if part in GRADIENT_CONTAINERS:
            return TensorHint(Role.GRADIENT, f"under {part!r}")
        if part in WEIGHT_CONTAINERS or part.endswith("_ema") or part.startswith("ema_"):
            return TensorHint(Role.WEIGHT, f"under {part!r}, a model state dict")
    return None


#: The ``__metadata__`` key gradaudit's own dumps write to say what they hold.
CONTENT_KEY = "gradaudit_content"


def metadata_evidence(metadata: Mapping[str, str] | None) -> FileEvidence | None:
    """What a file's string metadata says it holds, or None."""
    if not metadata:
        return None
    content = metadata.get(CONTENT_KEY)
    if content == "gradients" or (content is None and "gradaudit_version" in metadata):
        return FileEvidence(Role.GRADIENT, "gradaudit dump metadata")
    if content == "weights":
        return FileEvidence(Role.WEIGHT, f"metadata {CONTENT_KEY}: weights")
    fmt = metadata.get("format")
    if fmt in ("pt", "tf", "flax", "np", "mlx"):
        return FileEvidence(
            Role.WEIGHT, f"metadata format: {fmt}, as transformers writes for model weights"
        )
    return None


#: File names ``save_pretrained`` (transformers, diffusers, peft) and Meta's releases give
#: weight files, shards included: a name the library chose, so firm evidence.
_WEIGHT_FILE_NAMES = re.compile(
    r"(?:pytorch_model|model|diffusion_pytorch_model|adapter_model|tf_model|flax_model)"
    r"(?:-\d{5}-of-\d{5})?\.(?:bin|safetensors|pt|pth)"
    r"|consolidated(?:\.\d+)?\.(?:pth|safetensors)"
)


def file_name_evidence(path: str | None) -> FileEvidence | None:
    """What a file's name says it holds, or None: ``pytorch_model.bin``,
    ``model-00001-of-00002.safetensors`` … are what ``save_pretrained`` writes for weights.

    Before this a diverged BERT's ``pytorch_model.bin`` (a plain state dict, no norm-like
    scale left) was read as gradients on thin evidence (corpus/).
    """
    if path is None:
        return None
    name = re.split(r"[/\\]", path)[-1]
    if _WEIGHT_FILE_NAMES.fullmatch(name):
        return FileEvidence(
            Role.WEIGHT, f"file name {name}: what save_pretrained writes for weights"
        )
    return None


#: A 1-D tensor of at least this many elements may count as a normalisation weight.
NORM_LIKE_MIN_ELEMENTS = 16
NORM_LIKE_RMS = (0.25, 4.0)
#: max|x| / RMS at most this: values of one size, as a LayerNorm scale's are.
NORM_LIKE_PEAK = 1.3


def _a_buffer(names: Sequence[str]) -> str | None:
    """The first name that is a module buffer's (``bn1.running_mean``), or None.

    Only the buffers' words are looked for (:data:`_BUFFER_WORDS`): every name of a
    gradient dump holds ``grad``, which made each of them a candidate read one by one
    (81 ms for 100,000 ``params.N.grad``, more than the rest of their scan).
    """
    for index in np.flatnonzero(name_word_mask(names, _BUFFER_WORDS)).tolist():
        found = role_from_name(names[index])
        if found is not None and found[0] is Role.BUFFER:
            name: str = names[index]
            return name
    return None


def stats_evidence(tensors: Sequence[TensorStats], rows: np.ndarray | None = None) -> FileEvidence:
    """A flat file with no metadata and no structure: weights if it holds norm-like scales.

    Gradients are the default (today's behaviour, and what gradaudit is for); a file
    that looks like a model — a matrix, and 1-D tensors of which some, but at most half,
    look like a normalisation layer's scale (the others are biases) — is read as weights.
    A dump of hand-made vectors of ones is not a model. Both calls are marked thin, so
    the summary says how the file was read and how to say otherwise.

    :func:`norm_like` is applied to the columns at once (the same comparisons).
    ``rows`` (indices into ``tensors``) judges those tensors only, read in place: one
    file among several (a compare's side) costs no copy of the columns.
    """
    table = StatsTable.from_stats(tensors)
    if rows is None:
        rows = np.arange(len(table))
    buffer = _a_buffer(table.names if len(rows) == len(table) else [table.names[i] for i in rows])
    if buffer is not None:
        # Module buffers have no gradients: a file that holds one is a model's state dict.
        return FileEvidence(
            Role.WEIGHT,
            f"holds module buffers ({buffer}), which have no gradients: a model state dict",
        )
    ranks = table.ranks[rows]
    vector = ranks == 1
    rms = table.rms[rows]
    with np.errstate(invalid="ignore"):  # NaN RMS (nothing finite) compares False
        length = np.zeros(len(rows), dtype=np.int64)
        length[vector] = table.dims[table.starts[rows][vector]]
        hits = (
            vector
            & (length >= NORM_LIKE_MIN_ELEMENTS)
            & (table.zeros[rows] == 0)
            & (rms >= NORM_LIKE_RMS[0])
            & (rms <= NORM_LIKE_RMS[1])
            & (table.max_abs[rows] <= NORM_LIKE_PEAK * rms)
        )
    hit_count = int(hits.sum())
    has_matrix = bool(((ranks >= 2) & (table.numel[rows] >= NORM_LIKE_MIN_ELEMENTS)).any())
    if hit_count and has_matrix and 2 * hit_count <= int(vector.sum()):
        return FileEvidence(
            Role.WEIGHT,
            f"guessed from the values: {hit_count} 1-D tensor(s) with RMS near 1 and no "
            "zeros, like normalisation weights; --kind gradients if these are gradients",
            thin=True,
        )
    return FileEvidence(
        Role.GRADIENT,
        "no metadata or structure says otherwise; --kind weights for a model checkpoint",
        thin=True,
    )


_OPTIMIZER_ROLES = (Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT)


def decide(
    name: str,
    hint: TensorHint | None,
    kind: InputKind,
    file_role: FileEvidence,
) -> tuple[Role, str]:
    """The role of one tensor and its evidence, strongest evidence first (module docstring)."""
    by_name = role_from_name(name)
    if hint is not None and hint.role in _OPTIMIZER_ROLES:
        return hint.role, hint.evidence
    if by_name is not None and by_name[0] is Role.BUFFER:
        return by_name
    if hint is not None and hint.role is Role.BUFFER:
        return hint.role, hint.evidence
    if kind is InputKind.GRADIENTS:
        return Role.GRADIENT, "--kind gradients"
    if kind is InputKind.WEIGHTS:
        return Role.WEIGHT, "--kind weights"
    if hint is not None and hint.role is not None:
        return hint.role, hint.evidence
    if by_name is not None:
        return by_name
    return file_role.role, file_role.evidence


#: Every word :func:`role_from_name` looks for, in lower case: a name whose lower case
#: holds none of them gets no role from its name (:func:`role_from_name` compares its
#: lower-cased components, and a component's lower case is a piece of the name's).
NAME_WORDS = tuple(sorted(BUFFER_NAMES | GRADIENT_CONTAINERS | {"grad"}))


def _shortest(words: Iterable[str]) -> tuple[str, ...]:
    """The words no other of them lies in: a name holding ``gradients`` holds ``grad``."""
    unique = sorted(set(words))
    return tuple(w for w in unique if not any(v != w and v in w for v in unique))


#: What :func:`name_word_mask` searches for by default: the shortest of :data:`NAME_WORDS`.
_SEARCHED_WORDS = _shortest(NAME_WORDS)
#: The words of :data:`BUFFER_NAMES` alone, for :func:`_a_buffer`.
_BUFFER_WORDS = _shortest(BUFFER_NAMES)


def name_word_mask(
    names: Sequence[str], words: tuple[str, ...] = _SEARCHED_WORDS
) -> npt.NDArray[np.bool_]:
    """Which names hold one of ``words`` (lower case; by default :data:`NAME_WORDS`) in
    any case: those :func:`role_from_name` may read (a superset of them).

    Why not a case-insensitive regular expression per name: that costs 2-5 µs a name,
    more than a tiny tensor's whole scan. Instead all names are lower-cased as one string
    and each word is looked for with ``str.find`` (a memchr-speed search); only the hits
    are mapped back to names, so a plainly named model costs a few string searches.
    """
    count = len(names)
    mask = np.zeros(count, dtype=bool)
    if not count:
        return mask
    joined = "\n".join(names)
    lowered = joined.lower()
    if len(lowered) == len(joined):
        # No character grew (lower case never shrinks one), so offsets are the names'.
        lengths = names
    else:
        lengths = [name.lower() for name in names]
        lowered = "\n".join(lengths)
    ends: npt.NDArray[np.int64] | None = None
    for word in words:
        hits = lowered.count(word)
        if not hits:
            continue
        if hits * 4 > count:
            # Most names hold it (``….grad`` for every tensor): placing each hit costs more
            # than the reading that follows saves, so every name is a candidate.
            mask[:] = True
            return mask
        at = lowered.find(word)
        if ends is None:
            ends = np.cumsum(np.fromiter(map(len, lengths), dtype=np.int64, count=count) + 1)
        found = []
        while at >= 0:
            found.append(at)
            at = lowered.find(word, at + len(word))
        # A word holds no newline, so each hit lies inside one name.
        mask[np.searchsorted(ends, found, side="right")] = True
    return mask


_DIGITS_AS_ZERO = str.maketrans("123456789", "000000000")


def name_templates(names: Sequence[str]) -> list[str]:
    """Each name with its digits written ``0``: :func:`role_from_name` (and so
    :func:`decide`) gives a template the name's own answer.

    Why: ``params.7.grad`` and ``params.8.grad`` are read alike, so a hundred thousand such
    names are decided once per template, not once each. It holds because no word of
    :data:`NAME_WORDS` holds a digit: a component holding one matches no word before and
    after, and every other component is left as it was. (``str.translate`` over all the
    names joined is a third of what a regular expression's substitution costs.)
    """
    joined = "\n".join(names)
    if joined.count("\n") == len(names) - 1:
        # Split back where no name holds a newline.
        return joined.translate(_DIGITS_AS_ZERO).split("\n")
    return [name.translate(_DIGITS_AS_ZERO) for name in names]


def describe_file(roles: Counter[Role], file_role: FileEvidence) -> str:
    """What a file was read as, in a few words: ``training checkpoint``, ``weights`` …

    ``roles`` counts the file's tensors by role.
    """
    counts = +roles  # only the roles some tensor has
    if counts[Role.OPTIMIZER_MOMENT] or counts[Role.OPTIMIZER_SECOND_MOMENT]:
        return "training checkpoint" if counts[Role.WEIGHT] else "optimizer state"
    main = [r for r in counts if r not in (Role.BUFFER, Role.UNKNOWN)]
    if len(main) > 1:
        return "mixed"
    role = main[0] if main else file_role.role
    return {Role.WEIGHT: "weights", Role.GRADIENT: "gradients"}.get(role, role.value)


def file_evidence_text(rest: Counter[str], optimizer_state: bool, file_role: FileEvidence) -> str:
    """The evidence shown for a file: the most common reason among its tensors.

    ``rest`` counts the evidence of the tensors that are not optimizer state, in the
    order each reason first appears (a tie goes to the first). A file with optimizer
    state says so first, then why the rest was read as it was.
    """
    common = rest.most_common(1)[0][0] if rest else None
    if optimizer_state:
        return "a torch.optim state dict" + (f"; the rest {common}" if common else "")
    return common or file_role.evidence


def estimate_value(
    basis: EstimateBasis, norm: float, total: float | None, step: float | None
) -> tuple[float | None, float | None, bool]:
    """``(rms_norm, mean_norm, bias_corrected)`` of the gradient, from one state tensor.

    ``norm`` is the state tensor's L2 norm (first moments); ``total`` the sum of a
    second moment's elements.
    """
    t = step if step is not None and step > 0 else None
    total = None if total is None else max(total, 0.0)
    if basis.formula == "ema_sq" and total is not None:
        if basis.decay is None or t is None:
            return math.sqrt(total), None, basis.decay is None
        correction = 1.0 - basis.decay**t
        return (math.sqrt(total / correction) if correction > 0 else None), None, True
    if basis.formula == "mean_sq" and total is not None:
        return math.sqrt(total * basis.scale), None, True
    if basis.formula == "sum_sq" and total is not None and t is not None:
        # The accumulator started at ``initial`` per element; what the steps added is the rest.
        return math.sqrt(max(total - basis.initial * basis.scale, 0.0) / t), None, True
    if basis.formula == "ema" and basis.decay is not None:
        if t is None:
            return None, norm, False
        correction = 1.0 - basis.decay**t
        return None, (norm / correction if correction > 0 else None), True
    if basis.formula == "momentum" and basis.decay is not None and basis.dampening < 1.0:
        # Steady state of b = m*b + (1-d)*g for a constant g is (1-d)/(1-m) * g.
        return None, norm * (1.0 - basis.decay) / (1.0 - basis.dampening), False
    return None, None, False
