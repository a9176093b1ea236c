"""Hooks: which MMEngine hooks are swapped or added, and our own."""
