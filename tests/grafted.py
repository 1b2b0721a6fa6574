"""Real gradients for the compare tests: a small host model with a seed module grafted on.

In morphogenetic training a small *seed* is grafted onto a large *host*; here the host
is the fixtures' TinyLM and the seed a bottleneck adapter added residually after the
first block (both defined in ``fixtures/make_fixtures.py``, which also dumps them as
``fixtures/grafted_grads.safetensors``). One forward and backward pass on fixed random
tokens gives real gradients for both. Kept tiny so the tests stay fast; the benchmark
builds a ~100M-parameter version of the same thing.
"""

from __future__ import annotations

from fixtures.make_fixtures import Grafted, Seed, grads, grafted_model

__all__ = ["Grafted", "Seed", "grads", "grafted_model"]
