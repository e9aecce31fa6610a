"""The Hydra recipes (YAML), installed as the package ``moe_lc_recipes`` so a wheel carries them."""
