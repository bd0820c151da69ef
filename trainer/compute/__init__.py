"""Compute accounting from a model's config alone (no weights): the transformer's forward
FLOPs (``flops``), model FLOP utilisation per stage (``mfu``) and the per-GPU memory plan that
``--dry-run`` prints (``memory``). Formulas and sources: docs/compute-accounting.md."""
