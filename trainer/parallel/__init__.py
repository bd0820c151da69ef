"""Parallelism of the actor beyond FSDP2's data sharding: the (data x sequence) device mesh and
the transformer's sequence split over a group of ranks (``fsdp.sequence_parallel``).

``rules`` is torch-free (preflight imports it); ``sequence`` sets the split up with diffusers'
context parallelism and composes it with FSDP2.
"""
