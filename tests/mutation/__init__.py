"""The mutation check of the model's formulas (not collected by pytest: run mutate.py)."""
