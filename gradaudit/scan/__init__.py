"""Files or tensors in, a :class:`~gradaudit.results.Report` out.

``pending`` collects named tensors on the device (nothing read back) and reads
the files a scan is given (``reading``: one file, ``paths``: a scan of paths);
``collected`` turns the rows, once on the host, into a report; ``rules`` is the
per-tensor rule and ``finding_table`` its findings as columns; ``judge`` the roles,
outliers, estimates and summary (host side, numpy, no torch); ``torch_free`` scans
safetensors files on the CPU without torch. This ``__init__`` imports nothing: the
torch-free scan imports ``scan.collected`` without torch.
"""

from typing import TYPE_CHECKING

from gradaudit import _submodules

if not TYPE_CHECKING:  # ``gradaudit.scan.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
