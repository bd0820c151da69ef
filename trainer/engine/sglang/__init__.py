"""The SGLang engine: a client for a running SGLang diffusion server (``client``), the mapping
between our rollout schema and SGLang's ``/rollout/generate`` (``rollout``), weight sync in
SGLang's own payload format (``sync``, ``lora``), and the optional server plugin that adds what
stock SGLang lacks (``extension``)."""
