"""The README's pictures exist: every ``docs/images/…`` it names is a PNG in the repository.

The pictures are taken by the browser tests (``make screenshots`` writes them to ``docs/images``);
this test needs no browser, so it runs with the fast tests and fails as soon as the README names
a picture nobody took (or one that was renamed or deleted).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PICTURE = re.compile(r"!\[[^\]]*\]\((docs/images/[^)\s]+)\)")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def named_pictures(readme: str) -> list[str]:
    return PICTURE.findall(readme)


def test_every_picture_the_readme_names_is_in_docs_images() -> None:
    names = named_pictures((REPO / "README.md").read_text())
    assert names, "the README shows no picture from docs/images"
    missing = [name for name in names if not (REPO / name).is_file()]
    assert not missing, f"the README names {missing}, which do not exist: run `make screenshots`"
    not_png = [name for name in names if (REPO / name).read_bytes()[:8] != PNG_SIGNATURE]
    assert not not_png, f"{not_png} are not PNG files"


def test_the_readme_shows_the_panel_the_live_view_a_sweep_and_a_stop_that_saves() -> None:
    names = set(named_pictures((REPO / "README.md").read_text()))
    assert {"docs/images/panel-selection.png", "docs/images/panel-selection-dark.png",
            "docs/images/rank-view-live.png", "docs/images/sweep-table.png",
            "docs/images/stop-saving.png"} <= names


def test_a_missing_picture_is_found() -> None:
    readme = "Text ![the panel](docs/images/panel-selection.png) and ![gone](docs/images/nowhere.png)."
    names = named_pictures(readme)
    assert names == ["docs/images/panel-selection.png", "docs/images/nowhere.png"]
    assert [name for name in names if not (REPO / name).is_file()] == ["docs/images/nowhere.png"]
