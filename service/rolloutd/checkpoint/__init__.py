"""Snapshots of the buffer and controller state: format, store, checkpointer and restore."""
