"""The ds_config: loading, "auto" filling, checks, model-dependent settings."""
