"""Prompt data: the unified record schema and the prepare / curate / inspect tools
(``python -m trainer data ...``). Import-light: no torch."""
from trainer.data.schema import TASKS, record_problems

__all__ = ["TASKS", "record_problems"]
