"""Which kernel takes a tensor: the engine chosen, and the Triton kernel's share of the work.

The collector (:class:`~gradaudit.engine.stats.StatsCollector`) keeps rows and tickets;
this module answers the questions that change when a kernel is added or its rules move:
is ``--engine native`` or ``triton`` available (:func:`resolve_engine`), does Triton take
this tensor now (``auto`` waits until the data is worth a compile), which batch does it
wait in until the collector settles, and does a training loop's fixed list of gradients
reuse a plan (:mod:`~gradaudit.engine.triton_plan`). A failure to compile or launch is
remembered for the process (:func:`~gradaudit.engine.triton_kernel.failure`): ``auto``
goes on with the eager kernel, ``triton`` asked for by name is a usage error.
"""

from __future__ import annotations

import torch

from gradaudit.engine import native, torch_shim, triton_kernel, triton_plan
from gradaudit.engine.kernels import Engine
from gradaudit.errors import UsageError


class EngineUnavailable(UsageError):
    """``--engine native`` or ``triton`` was asked for, but it is not built or installed."""


def resolve_engine(engine: Engine | str) -> Engine:
    """The engine for CPU tensors: ``auto`` -> native when built, else eager.

    ``native`` must be built and ``triton`` installed. Which kernel reduces
    CUDA tensors under ``auto`` is :func:`uses_triton`'s answer.
    """
    engine = Engine(engine)
    if engine is Engine.AUTO:
        return Engine.NATIVE if native.available() else Engine.EAGER
    if engine is Engine.NATIVE and not native.available():
        raise EngineUnavailable(
            "the native kernel is not built (reinstall gradaudit with a C compiler "
            "present); use --engine eager or auto"
        )
    if engine is Engine.TRITON and not triton_kernel.installed():
        raise EngineUnavailable(
            "Triton is not installed (PyTorch's CUDA builds bring it; or pip install "
            "triton); use --engine eager or auto"
        )
    return engine


def uses_triton(engine: Engine | str) -> bool:
    """Whether the Triton kernel reduces the blocks it takes: asked for, or ``auto`` with Triton."""
    engine = Engine(engine)
    return engine is Engine.TRITON or (engine is Engine.AUTO and triton_kernel.installed())


def triton_unavailable(cause: str | None) -> EngineUnavailable:
    return EngineUnavailable(
        f"the Triton kernel could not run ({cause}); use --engine eager or auto"
    )


_UNDECIDED = object()
#: The route of tensors Triton would take while ``auto`` waits before compiling.
_COLD = object()


class TritonRoutes:
    """The Triton kernel's side of one collector: what it takes, the batches waiting for it
    until the next settle, and the plans of fixed lists (shared with :meth:`fresh` ones)."""

    def __init__(self, engine: Engine | str) -> None:
        # Blocks the Triton kernel takes go to it: on CUDA (under auto too), and
        # on the CPU through its interpreter when it was asked for by name.
        self.enabled = uses_triton(engine)
        self.asked = Engine(engine) is Engine.TRITON
        if self.asked and triton_kernel.failure() is not None:
            raise triton_unavailable(triton_kernel.failure())
        self.devices = frozenset({"cuda", "cpu"} if self.asked else {"cuda"})
        #: Whether tensors off CUDA may be Triton's (the CPU, through the interpreter).
        self.off_cuda = self.asked
        self.kernel = triton_kernel.TritonKernel()
        #: The planned flush of the last list of tensors :meth:`launch_planned` took, per
        #: device (``None``: one list came, not planned); shared with every :meth:`fresh`
        #: routes (a training loop's next step).
        self.plans: dict[torch.device, triton_plan.TritonPlan | None] = {}
        self._new_batches()

    def _new_batches(self) -> None:
        #: Tensors waiting for one Triton launch per dtype, per device.
        self.batches: dict[torch.device, triton_kernel.TritonBatch] = {}
        #: (device, dtype) -> the batch its tensors join, or None (not Triton's).
        self.routes: dict[tuple[torch.device, torch.dtype], object] = {}

    def fresh(self) -> TritonRoutes:
        """The same choices, kernel and plans, with no batch waiting and no route decided."""
        other = TritonRoutes.__new__(TritonRoutes)
        other.__dict__.update(self.__dict__)
        other._new_batches()
        return other

    def forget_routes(self) -> None:
        """Routes are decided once per settle: a cold one must not outlive it either."""
        self.routes = {}

    def take_batches(self) -> dict[torch.device, triton_kernel.TritonBatch]:
        """The waiting batches, to launch now; none wait after this, no route is kept."""
        batches, self.batches = self.batches, {}
        self.routes = {}
        return batches

    def takes(self, block: torch.Tensor) -> bool:
        """Whether the Triton kernel takes ``block`` now (raises when asked for and failed)."""
        if not (self.enabled and block.device.type in self.devices):
            return False
        if self.asked and triton_kernel.failure() is not None:
            raise triton_unavailable(triton_kernel.failure())
        if not self.asked and not triton_kernel.compile_worth(block.device):
            return False  # auto, cold: eager until the data is worth a compile
        return triton_kernel.takes(block)

    def failed(self, error: Exception) -> None:
        """Triton compiles on first use and needs a C compiler and a supported GPU.

        Whatever stops it is remembered for the whole process
        (:func:`~gradaudit.engine.triton_kernel.failure`): ``auto`` goes on with the
        eager kernel and never tries again, ``triton`` asked for by name is a
        usage error.
        """
        cause = triton_kernel.record_failure(error)
        if self.asked:
            raise triton_unavailable(cause) from None

    def rows(self, block: torch.Tensor) -> torch.Tensor | None:
        """Rows of a 2-D block by the Triton kernel, or ``None``: not its (or it failed under
        ``auto``), the engine's own kernel takes the block."""
        if not self.takes(block):
            return None
        try:
            rows = self.kernel(block)
        except Exception as error:  # noqa: BLE001
            self.failed(error)
            return None
        triton_kernel.mark_warm(block.device)
        return rows

    def batch_for(self, tensor: torch.Tensor) -> triton_kernel.TritonBatch | None:
        """The batch a contiguous tensor joins, or ``None`` when Triton does not take it.

        Decided once per (device, dtype) for each settle: this runs for every
        tensor, and with hundreds of them per step its cost is the host's.
        """
        key = (tensor.device, tensor.dtype)
        batch = self.routes.get(key, _UNDECIDED)
        if batch is _UNDECIDED:
            batch = self._route(key, tensor)
        if batch is _COLD:
            if not triton_kernel.defer(tensor.numel() * tensor.element_size()):
                return None
            # This tensor reached COMPILE_AFTER_BYTES: decided again, it and the later ones
            # join the batch. A kept cold route sent each of them through row() alone (two
            # launches, a table copy and two allocations per tensor).
            batch = self._route(key, tensor)
            if batch is _COLD:
                return None
        return batch  # type: ignore[return-value]

    def _route(self, key: tuple[torch.device, torch.dtype], tensor: torch.Tensor) -> object:
        """Decide (and remember until the next settle) where ``key``'s tensors go: a
        Triton batch, ``_COLD`` (eager while ``auto`` waits to compile) or ``None``."""
        route: object = None
        if self.takes(tensor):
            route = self.batches.get(key[0])
            if route is None:
                route = self.batches[key[0]] = triton_kernel.TritonBatch(key[0])
        elif self._cold(tensor):
            route = _COLD
        self.routes[key] = route
        return route

    def _cold(self, tensor: torch.Tensor) -> bool:
        """Whether Triton would take ``tensor`` but ``auto`` waits before compiling for it."""
        return (
            not self.asked
            and triton_kernel.takes(tensor)
            and not triton_kernel.compile_worth(tensor.device)
        )

    def launch(self, batch: triton_kernel.TritonBatch) -> tuple[torch.Tensor, list[int]] | None:
        """One launch per dtype for every tensor of ``batch``: its rows and their tickets, or
        ``None`` when Triton failed (under ``auto``: the eager kernel takes the tensors)."""
        try:
            if triton_kernel.failure() is not None:  # failed since these were queued
                raise triton_unavailable(triton_kernel.failure())
            return batch.launch()
        except Exception as error:
            if not isinstance(error, EngineUnavailable):
                self.failed(error)
            elif self.asked:
                raise
            return None

    def launch_planned(
        self, tensors: list[torch.Tensor]
    ) -> tuple[torch.Tensor, triton_plan.TritonPlan] | None:
        """Launch a list of tensors in one flush planned once per list of facts; the rows
        and the plan, or ``None`` when the list is not for this path
        (:meth:`~gradaudit.engine.stats.StatsCollector.submit_planned` says when)."""
        # Exact plain types are checked with the plan's other facts (in the native pass, or
        # by _plan): a separate pass cost 0.19 ms a step for 10,000 tensors on an H200's host.
        if not (self.enabled and tensors):
            return None
        device = tensors[0].device
        if device.type not in self.devices:
            return None
        if device not in self.plans and not torch_shim.bound():
            # The first list of this collector (and its fresh ones) on this device, its
            # facts asked of torch's binding: planning costs about the per-tensor flush for
            # 420 tensors (0.86-0.90 against 0.95 ms) and more for 10,000 (39 against 27 ms),
            # and a one-off audit never comes back to use the plan (bench_gpu
            # --host-cost-only, load 3.3). Read through torch's C shim a plan costs half the
            # per-tensor flush for 420 tensors (0.43 against 0.89 ms) and a fifth for 10,000
            # (4.3 against 22 ms; load 1): the first list is planned too.
            self.plans[device] = None
            return None
        known = self.plans.get(device)
        try:
            addresses = None if known is None else known.pointers(tensors)
            plan = known
            if addresses is None or plan is None:
                plan = self._plan(tensors)
                if plan is None:
                    return None
                addresses = plan.first_pointers(tensors)
        except RuntimeError:  # a layout without contiguity or an address (sparse)
            return None
        for first in plan.firsts:
            if not self.takes(tensors[first]):  # decided per dtype group
                return None
        host = plan.table(addresses)
        if host is None:
            return None
        triton_plan.release_finished()
        try:
            out = plan.launch(tensors, host)
        except Exception as error:  # noqa: BLE001 (a compile or launch failure, as in settle)
            self.failed(error)
            return None
        triton_plan.hold(device, tensors)
        if device.type == "cuda":
            triton_kernel.mark_warm(device)
        return out, plan

    def _plan(self, tensors: list[torch.Tensor]) -> triton_plan.TritonPlan | None:
        """A new plan for ``tensors`` (kept for the next list), or ``None`` when the Triton
        kernel would not take each of them as it is."""
        device = tensors[0].device
        plan = triton_plan.plan_for(tensors, triton_kernel.sms_of(device))
        if plan is not None:
            self.plans[device] = plan
        return plan
