"""Run at the start of every Python process the test session starts (tests/conftest.py puts this folder first on
PYTHONPATH; a test that puts a sitecustomize of its own first, as the GPU check's does, replaces this one): those
processes see the packages of a user's install of tcjepa.

scikit-learn is installed for the tests' references only (pyproject's `dev` extra), and transformers imports it
whenever it is installed (`transformers.generation`, for assisted decoding we never use): 0.7 CPU-seconds more for
each `tcjepa embed`, 1.3-1.9 for a bare import of transformers' generation code. `None` in `sys.modules` makes it
absent to `importlib.util.find_spec` and to `import` (its metadata stays: code that checks the installed
distributions before importing would fail), and the pytest processes themselves keep it (tests/conftest.py removes
the entry). A test that runs `benchmarks/probe_check.py` (scikit-learn's fits) in a process of its own must take this
folder off that process's PYTHONPATH.
"""

import sys

sys.modules["sklearn"] = None  # type: ignore[assignment]
