"""Evaluation: reads training runs (never trains): frozen-feature probes, export, grounding plots."""
