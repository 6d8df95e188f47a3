"""Run at the start of every Python process the test session starts (tests/conftest.py puts this folder first on
PYTHONPATH): those processes see the packages of a user's install of tcjepa.

scikit-learn is installed for the tests' references only (pyproject's `dev` extra), and transformers imports it
whenever it is installed (`transformers.generation`, for assisted decoding we never use): ~2 CPU-seconds in every
process that loads a model, ~80 in a session. `None` in `sys.modules` makes it absent to `importlib.util.find_spec`
and to `import`; the pytest processes themselves keep it (tests/conftest.py removes the entry).
"""

import sys

sys.modules["sklearn"] = None  # type: ignore[assignment]
