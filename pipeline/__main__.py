"""`python -m pipeline` runs the same app as the `tcjepa` console script."""

from pipeline.cli import main

main()
