"""The README's and the docs' examples run as written; the README is a front door."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.docs.examples import PAGES, README, blocks

#: The integration extras an example may import: CI's main leg installs every one; the
#: torch-floor leg (a torch the frameworks' current releases refuse) installs none, and
#: there an example that imports one is skipped, not failed.
EXTRAS = frozenset({"transformers", "accelerate", "lightning", "tensorboard", "wandb"})


EXAMPLES = blocks("python")


def _ids(examples: list[tuple[Path, str]]) -> list[str]:
    """``page.md#k``: the k-th Python example of that page, from 1."""
    seen: dict[str, int] = {}
    ids = []
    for page, _ in examples:
        seen[page.name] = seen.get(page.name, 0) + 1
        ids.append(f"{page.name}#{seen[page.name]}")
    return ids


def test_docs_have_python_examples() -> None:
    assert EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=_ids(EXAMPLES))
def test_python_examples_run(example: tuple[Path, str]) -> None:
    page, block = example
    for dtype in re.findall(r"\btorch\.(float\d\w*)", block):
        if not hasattr(torch, dtype):  # the newer dtypes, on the oldest torch claimed
            pytest.skip(f"uses torch.{dtype}, newer than torch {torch.__version__}")
    try:
        exec(compile(block, str(page), "exec"), {"__name__": "readme"})
    except ModuleNotFoundError as error:
        # Directly or through gradaudit's adapter: only a missing extra is a skip.
        missing = (error.name or "").split(".")[0]
        if missing not in EXTRAS or importlib.util.find_spec(missing) is not None:
            raise
        pytest.skip(f"needs {missing}, an extra that is not installed")
    finally:
        # An example that compiles (docs/training.md) leaves flush-to-zero on, on torch 2.4:
        # what it does to the user's thread must not reach the next test in this process.
        torch.set_flush_denormal(False)


def test_readme_documents_every_exit_code() -> None:
    from gradaudit import ExitCode

    text = README.read_text(encoding="utf-8")
    for code in ExitCode:
        assert f"| `{int(code)}` |" in text


def test_readme_is_a_front_door() -> None:
    """Short, and every docs page is reachable from it."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in text, f"README does not link {page.name}"


def test_relative_links_resolve() -> None:
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text("utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", prose):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
