"""`python -m pipeline` runs the same app as the `tcjepa` console script."""

from pipeline.cli import app

app(prog_name="tcjepa")
