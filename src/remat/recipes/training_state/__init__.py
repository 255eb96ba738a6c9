"""Saved training state (not activation checkpointing): single-file and sharded layouts."""
