"""The model: one plain-PyTorch reference per piece (SPEC 2)."""
