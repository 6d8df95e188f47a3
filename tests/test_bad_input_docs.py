"""The README's bad-input table quotes the messages users will see: each quoted phrase must still be in the code."""

from __future__ import annotations

import re

from tests.conftest import REPO

PACKAGES = ("pipeline", "captioning", "embedding_cache", "train")


def test_every_quoted_message_is_in_the_code():
    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- bad-input:begin -->")[1].split("<!-- bad-input:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) >= 20
    source = "\n".join(p.read_text() for package in PACKAGES for p in (REPO / package).rglob("*.py"))
    missing = [phrase for row in rows for phrase in re.findall(r'"([^"]+)"', row.rsplit("|", 2)[1]) if phrase not in source]
    assert not missing, f"README quotes messages the code no longer says: {missing}"
