"""Small utilities shared across the trainer: value checks (``values``), crash-safe file
writing (``fsio``), dtype names (``dtypes``), garbage-collection control (``host_gc``) and the
small collectives every rank agrees through (``collectives``)."""
