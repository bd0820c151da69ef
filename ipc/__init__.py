"""Weight-sync transport: trainer rank -> colocated rollout engine, one copy per byte.

Public API:
    channel_pair() -> (sender_end, receiver_end)
    WeightReceiver(conn, params, *, modes=None, backend="auto", timeout_s=60.0, verify="full")
        .start(), or .serve(conn) for a connection made later (conn=None at construction)
    WeightSender(conn, *, backend="auto", bucket_bytes=512 << 20, timeout_s=60.0)
    WeightSyncError, SyncStats, LazyTensor, weights_checksum(tensors)

Backends: "cuda" (cupy IPC memory + IPC events, Triton copy+checksum kernel) and "shm"
(CPU shared memory, same protocol; what CI runs). Imports torch; cupy and triton only when
the CUDA backend is used.
"""
from ipc.checksum import weights_checksum
from ipc.protocol import LazyTensor, SyncStats, WeightSyncError, channel_pair
from ipc.receiver import WeightReceiver
from ipc.sender import WeightSender

__all__ = ["WeightSender", "WeightReceiver", "WeightSyncError", "SyncStats", "LazyTensor",
           "channel_pair", "weights_checksum"]
