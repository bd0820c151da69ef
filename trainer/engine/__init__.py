"""Rollout engines: the embedded engine (a process per GPU, or in-process) and the SGLang client.

    from trainer.engine import launch_embedded_engine, EngineClient, SGLangEngineClient

Both clients answer the same calls (generate, checksum, version, release, resume, health,
update_weights_from_disk, close) with the same response schema (trainer/models/wire/).
See trainer/engine/README.md.
"""
from trainer.engine.embedded.client import EngineClient, EngineError
from trainer.engine.embedded.core import EngineStateError
from trainer.engine.embedded.process import launch_embedded_engine
from trainer.engine.embedded.request import RequestError
from trainer.engine.sglang.client import EngineRequestError, SGLangEngineClient

__all__ = ["EngineClient", "EngineError", "EngineRequestError", "EngineStateError", "RequestError",
           "SGLangEngineClient", "launch_embedded_engine"]
