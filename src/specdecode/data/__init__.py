"""Data shipped with specdecode (the Spec-Bench questions)."""
