"""The one host read: device blocks of stats rows copied to the host, one transfer per device.

Everything before this stays on the device (:mod:`gradaudit.engine.stats`); a scan, a
comparison and a monitor's step read their rows back here, once, after the collector's
settle events (:meth:`~gradaudit.engine.stats.StatsCollector.settled`) so that rows
collected on a side stream are read after the kernels that wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def blocks_by_device(blocks: list[torch.Tensor]) -> dict[torch.device, list[int]]:
    """The indices of ``blocks`` on each device, in first-seen order."""
    by_device: dict[torch.device, list[int]] = {}
    for index, block in enumerate(blocks):
        by_device.setdefault(block.device, []).append(index)
    return by_device


def wait_for(device: torch.device, events: Mapping[torch.device, list[torch.cuda.Event]]) -> None:
    """Make ``device``'s current stream wait (on the device) for its settle events."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    for event in events.get(device, ()):
        stream.wait_event(event)


def read_blocks(
    blocks: list[torch.Tensor],
    settled: Mapping[torch.device, list[torch.cuda.Event]] | None = None,
) -> list[torch.Tensor]:
    """Copy device blocks ``[k_i, 7]`` to the host: one transfer per device.

    Blocks normally share one device; blocks spread over several devices cost
    one read for each, each queued on its own device after the ``settled``
    events of that device (:meth:`StatsCollector.settled`). Returns CPU blocks
    in the order given; blocks already on the CPU come back as they are.
    """
    host: list[torch.Tensor | None] = [None] * len(blocks)
    for device, indices in blocks_by_device(blocks).items():
        if device.type == "cpu":  # already on the host: no copy
            for i in indices:
                host[i] = blocks[i]
            continue
        if device.type == "cuda":
            with torch.cuda.device(device):
                wait_for(device, settled or {})
                stacked = torch.cat([blocks[i] for i in indices]).to("cpu")
        else:
            stacked = torch.cat([blocks[i] for i in indices]).to("cpu")
        offset = 0
        for i in indices:
            rows = blocks[i].shape[0]
            host[i] = stacked[offset : offset + rows]
            offset += rows
    return [block for block in host if block is not None]
