"""The SGLang engine: a client for a running SGLang diffusion server and the weight syncs into it.

Trainer side:
- ``client``: ``SGLangEngineClient``, the engine calls over SGLang's HTTP routes.
- ``rollout``: our rollout schema <-> SGLang's ``/rollout/generate`` (one request per
  candidate, its msgpack answer mapped back; the per-family condition tables).
- ``sync``: the stock weight sync (``/update_weights_from_tensor`` or disk + SGLang's checker)
  and ``connect_sglang``, which picks it or the extension's transport for a run.
- ``verify``: which tensors a stock sync hashes for the checker (bounded cost per step).
- ``lora``: LoRA adapter syncs as SGLang's ``lora_merge`` and the merged weights' digests.
- ``packing``: SGLang's packing table (served names of packed parameters such as
  ``to_added_qkv``).
- ``transport``: ``SGLangTransport``, our ``ipc`` sender connected to a worker's receiver
  (full weights, and the LoRA pairs of adapter sync mode).

Server side (loaded into SGLang with ``SGLANG_PLUGINS=flowgrpo``):
- ``extension``: the plugin's hooks (driver sigmas, x_T and step noise, ``dance``; the
  receiver's install, its route, dirty-weight refusal, DiT kept resident).
- ``receiver``: the ``ipc.WeightReceiver`` on each worker's native DiT and its descriptor.
- ``lora_receiver``: LoRA adapter syncs into that DiT (the pairs staged, checked, merged at
  commit, rolled back on failure).
"""
