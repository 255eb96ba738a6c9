"""Recipes: the config schema, loading with overrides, and the fine-tuning loop that composes the components."""
