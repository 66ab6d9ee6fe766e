"""Scenario scripts reproducing the paper's three experiments (see RESULTS.md)."""
