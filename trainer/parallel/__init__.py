"""Parallelism of the actor beyond FSDP2's data sharding: the (data x sequence) device mesh, the
transformer's sequence split over a group of ranks (``fsdp.sequence_parallel``), and the batch
each sequence group trains on.

``rules`` is torch-free (preflight imports it); ``sequence`` sets the split up with diffusers'
context parallelism (Ulysses, or ring where the degree does not divide the heads) and composes
it with FSDP2; ``cpu_flash_attention`` is the attention backend ring runs with on the CPU;
``group_batch`` joins the rollout slices of a sequence group's ranks so that each of them
replays the same samples.
"""
