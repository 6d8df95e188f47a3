"""Where the repository is."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
