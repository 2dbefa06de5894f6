"""The project's Flower apps (``server_app.py``, ``client_app.py``), imported from Python.

They live beside the package at the project root, where Flower's ``[tool.flwr.app.components]``
finds them; simulations and tests call their handlers directly.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def import_app(name: str) -> Any:
    """The module ``server_app`` or ``client_app`` of the project root."""
    if str(PROJECT_ROOT) not in sys.path:
        sys.path.insert(0, str(PROJECT_ROOT))
    return importlib.import_module(name)
