"""The command-line tools: ``python -m fusepatch doctor / list / demo / warmup / build``."""
