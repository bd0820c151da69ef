"""FlowGRPO trainer: config, preflight, data, model adapters, engines, rollout, rewards,
the FSDP2 actor, checkpoints, metrics, profiling and the CLI (``python -m trainer``)."""
__version__ = "0.1.0"
