"""tcjepa pipeline: the `tcjepa` CLI and the pieces every stage shares."""
