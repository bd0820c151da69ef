"""Parallelism of the actor beyond FSDP2's data sharding: the (data x sequence) device mesh, the
transformer's sequence split over a group of ranks (``fsdp.sequence_parallel``), and the batch
each sequence group trains on.

``rules`` is torch-free (preflight imports it); ``sequence`` sets the split up with diffusers'
context parallelism and composes it with FSDP2; ``group_batch`` joins the rollout slices of a
sequence group's ranks so that each of them replays the same samples.
"""
