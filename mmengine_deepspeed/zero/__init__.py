"""ZeRO specifics: partitioned construction, gathering, 0-dim and unused parameters."""
