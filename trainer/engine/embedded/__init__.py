"""The embedded rollout engine: one process per GPU (or in-process) that loads the diffusers
pipeline parts and serves generate / update_weights / release / resume / checksum / health in
SGLang's diffusion rollout schema (``core``: state and operations; ``request``: its reading of a
rollout request; ``sampler``: the denoising loop; ``lora_merge``; ``process`` and ``client``: the
trainer-side handle and its transports; ``http_server``: the loopback HTTP mode)."""
