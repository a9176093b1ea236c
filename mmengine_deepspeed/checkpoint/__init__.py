"""Checkpoints: layout and checks, save/resume/load_from, safe loading, export."""
from .export import consolidated_state_dict, export_checkpoint
from .layout import CheckpointError, check_checkpoint, find_latest_complete, is_complete

__all__ = ['CheckpointError', 'check_checkpoint', 'consolidated_state_dict',
           'export_checkpoint', 'find_latest_complete', 'is_complete']
