"""Data shipped with specdecode (the Spec-Bench questions, the tuning prompts) and the reader of the ShareGPT
conversations that training, the draft vocabularies and the datastores use (sharegpt.py)."""
