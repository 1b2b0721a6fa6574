"""The README's and the docs' examples run as written; the README is a front door."""

from __future__ import annotations

from tests.docs.examples import PAGES, README, blocks


def test_docs_have_python_examples() -> None:
    assert blocks("python")


def test_python_examples_run() -> None:
    for page, block in blocks("python"):
        exec(compile(block, str(page), "exec"), {"__name__": "readme"})


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
    import re

    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text("utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", prose):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
