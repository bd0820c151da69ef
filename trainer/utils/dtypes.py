"""Config and command-line dtype names -> torch dtypes (the one table)."""
from __future__ import annotations

import torch

from trainer.utils.values import RUN_DTYPES  # noqa: F401  (the names a run accepts; re-exported)

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                        "fp16": torch.float16}
