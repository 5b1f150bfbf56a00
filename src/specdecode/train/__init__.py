"""Training feature-level draft heads on this machine (see trainer.py)."""
