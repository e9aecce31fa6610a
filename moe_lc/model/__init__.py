"""The model: one plain-PyTorch reference per piece (docs/design.md §1-§7)."""
