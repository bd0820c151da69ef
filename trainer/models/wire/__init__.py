"""The rollout wire schema (SGLang's diffusion rollout shape), its JSON codec and its checks, in
one place that the engines (which answer it) and the trainer side (which builds requests and
packs responses) both import: ``request`` (``build_request``), ``response`` (checks and
``pack``), ``codec`` (tensors as JSON), ``model`` (what the wire asks of a model family, the
``WireModel`` protocol that ``GenerativeModelAdapter`` meets: the wire never imports the
adapter, so the adapter's ``build_rollout_request`` / ``validate_rollout_response`` /
``pack_trajectory`` can hand over to it without an import circle).

One schema for both engines: the embedded engine answers it in-process (tensors) and over
HTTP (JSON, POST ``ROLLOUT_PATH``); an SGLang diffusion server answers it over HTTP. The
adapter builds the request, checks the response and packs it (``GenerativeModelAdapter``
delegates here); the engine produces exactly the response below.

Request (``request.build_request``; plain JSON types
only, so ``json.dumps`` works as is)::

    prompt                          list[str]   B candidate prompts (a group repeats its prompt)
    seed                            int         base seed of the run (the engine's own RNG seed)
    width, height                   int         pixels (``Geometry.request_fields``)
    num_frames                      int         video only (frames > 1); absent: an image
    num_inference_steps             int         N, every step is run
    guidance_scale                  float       1.0, or > 1: CFG against the empty prompt
    rollout                         True
    rollout_sde_type                "sde" | "dance" | "cps" (flowgrpo_kernels.sde_types.SDE_TYPES)
    rollout_noise_level             float       eta
    rollout_sde_step_indices        list[int]   the S SDE steps (sorted, unique, in [0, N))
    rollout_return_dit_trajectory   True
    rollout_return_denoising_env    True
    extra_sampling_params           dict:
        sample_ids                  list[str]   B stable candidate ids
        group_index                 list[int]   B, prompt group of each candidate
        rollout_id                  int | None
        model_family                str         adapter family that built the request
        latent_shape                list[int]   per-candidate latent, transformer layout
        init_noise_latent_shape     list[int]   shape x_T is drawn in before packing, [C, h, w]
        sigmas                      list[float] N+1 schedule, 1.0 ... 0.0   (driver_sigmas)
        noise_recipe                str         ``noise.RECIPE``            (driver_xt)
        initial_noise_seed          int         seed of the recipe          (driver_xt)
        sigma_one                   str         "refuse" | "clamp_to_next" (sigma == 1, sde_types)
        log_prob_form               str         "gaussian" | "squared_residual" (kernels)
        train_step_indices          list[int]   trained subset of the SDE steps (optional;
                                                absent = all; pack keeps only these)
        condition_images            list[list[str]]  per candidate, its reference images as
                                                ``trainer.media.ImageRef`` entries (paths or
                                                data URIs); absent: none (text-to-image)
        initial_noise_ids           list[str]   B ids x_T is drawn from (optional, driver_xt;
                                                absent = sample_ids). The driver's
                                                ``init_same_noise`` gives every candidate of a
                                                group its first candidate's id here.

Step i goes from sigmas[i] to sigmas[i+1]. With ``driver_sigmas`` the engine uses ``sigmas``
exactly as given (it must not shift them again). With ``driver_xt`` x_T is
``adapter.initial_latents(sample_ids, ..., seed=initial_noise_seed)`` and the noise of SDE step
i is ``adapter.step_noise(sample_ids, i, latent_shape, seed=initial_noise_seed)``; without it the
keys are absent and the engine draws from its own RNG seeded with ``seed``.

Response (``response.ROLLOUT_RESPONSE_FIELDS``; in-process every tensor is a ``torch.Tensor``; over
JSON a tensor is ``codec.encode_tensor``'s tagged base64 safetensors blob, or a nested list)::

    rollout_log_probs       [B, S] float32     log N(x_{i+1}; mean_i, std_i^2), mean over elements
    dit_trajectory          dict:
        latents             [B, S, 2, *latent] (x_i, x_{i+1}) at each SDE step i, transformer
                                               layout, the dtype the engine sampled in
        timesteps           [N] float32        the family's timestep of each step
                                               (``adapter.timesteps_from_sigmas``)
        sigmas              [N+1] float32      the schedule actually used
    denoising_env           dict name -> [B, ...]  frozen conditions, ``adapter.encode_conditions``
                                               (reference-image latents included: the replay
                                               takes exactly these); with CFG also the empty
                                               prompt's, "neg:"-prefixed
    sde_indices             list[int]          echo of rollout_sde_step_indices
    height, width           int                echo of the request (the only source of the grid)
    num_frames              int                echo, when the request sent it
    sample_ids              list[str]          echo of extra_sampling_params.sample_ids
    images                  [B, H, W, 3] uint8 decoded images (optional)
    policy_version          int                the engine's committed weight version (optional)

Why pairs and not the S+1 chain: the trained steps need not be contiguous (e.g. [1, 3, 5]), and each replayed transition needs exactly its own x_i and x_{i+1}.
"""
from trainer.models.wire.codec import (TENSOR_TAG, decode_tensor, encode_tensor,  # noqa: F401
                                       from_jsonable, from_wire, to_jsonable, to_wire)
from trainer.models.wire.model import WireModel  # noqa: F401
from trainer.models.wire.request import (CONDITION_IMAGES_KEY, ROLLOUT_PATH,  # noqa: F401
                                         build_request)
from trainer.models.wire.response import (ROLLOUT_RESPONSE_FIELDS, coerce_response,  # noqa: F401
                                          pack, response_problems, validate_response)
