"""HTTP mode of the embedded engine through ``SGLangEngineClient`` (one batched JSON request),
4xx with every problem named, state endpoints, weight reload from disk; and the mapping of
SGLang 0.5.23's per-output answers onto our schema (no SGLang install needed here; the real
HTTP layer is exercised in tests/test_sglang_api.py)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from engine_fixtures import ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir, make_request
from trainer.engine import (EngineRequestError, EngineStateError, SGLangEngineClient,
                            launch_embedded_engine)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = ["a red panda"] * 2 + ["a teacup"] * 2
IDS = ["prompt:1:sample:0", "prompt:1:sample:1", "prompt:2:sample:0", "prompt:2:sample:1"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_fixture_model_dir(tmp_path_factory.mktemp("fixture_http"))
    client = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    http_port=0, in_process=True)
    yield client, FixtureAdapter(str(model_dir)), model_dir
    client.close()


def _post(url: str, body: bytes, method: str = "POST", headers=None):
    req = urllib.request.Request(url, data=body, method=method,
                                 headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _assert_same_response(a, b):
    for key in ("sample_ids", "sde_indices", "height", "width", "policy_version"):
        assert a[key] == b[key], key
    for key in ("rollout_log_probs", "images"):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for key in ("latents", "timesteps", "sigmas"):
        assert torch.equal(a["dit_trajectory"][key], b["dit_trajectory"][key]), key
    assert a["denoising_env"].keys() == b["denoising_env"].keys()
    for key in a["denoising_env"]:
        assert torch.equal(a["denoising_env"][key], b["denoising_env"][key]), key


def test_schema_round_trip_equals_in_process(served):
    engine, adapter, _ = served
    request = make_request(adapter, PROMPTS, IDS)
    remote = SGLangEngineClient(engine.http_url)
    via_http = remote.generate(request)
    _assert_same_response(engine.generate(request), via_http)
    adapter.validate_rollout_response(via_http, request)
    # auto-detection: the embedded engine identifies itself, so one batched POST is used
    assert remote.embedded is True


def test_raw_json_response_validates_with_the_adapter(served):
    """The wire JSON itself (tensors as tagged blobs) is what the adapter's schema accepts."""
    engine, adapter, _ = served
    request = make_request(adapter, PROMPTS[:2], IDS[:2])
    status, body = _post(engine.http_url + "/rollout/generate", json.dumps(request).encode())
    assert status == 200
    batch = adapter.pack_trajectory(body, request)
    assert batch.latents.shape[:2] == (2, 3) and batch.images.dtype == torch.uint8


def test_malformed_requests_get_4xx_with_every_problem(served):
    engine, adapter, _ = served
    url = engine.http_url
    good = make_request(adapter, PROMPTS, IDS)
    bad = dict(good, height=33, guidance_scale=0.5, rollout_sde_step_indices=[5, 2],
               rollout_noise_level="high", seed="x")
    status, body = _post(url + "/rollout/generate", json.dumps(bad).encode())
    assert status == 400
    text = "\n".join(body["problems"])
    for fragment in ("multiples of 16", "guidance_scale", "sorted and unique",
                     "rollout_noise_level must be", "seed must be an integer"):
        assert fragment in text, fragment
    assert len(body["problems"]) >= 5 and body["error"].startswith("invalid rollout request")

    assert _post(url + "/rollout/generate", b"{not json")[0] == 400
    assert _post(url + "/rollout/generate", b"[1, 2]")[0] == 400
    assert _post(url + "/nope", b"{}")[0] == 404
    status, body = _post(url + "/rollout/generate", None, method="GET")
    assert status == 405 and "not allowed" in body["error"]
    status, body = _post(url + "/update_weights_from_disk", b'{"target_modules": ["vae"]}')
    assert status == 400 and len(body["problems"]) == 2

    remote = SGLangEngineClient(url)
    with pytest.raises(EngineRequestError) as info:
        remote.generate(bad)
    assert info.value.status == 400 and "guidance_scale" in str(info.value)


def test_state_endpoints(served):
    from ipc import weights_checksum

    engine, adapter, _ = served
    remote = SGLangEngineClient(engine.http_url)
    assert remote.health()["engine"] == "flowgrpo-embedded"
    assert remote.version == engine.version == 0
    core = engine._transport.core
    assert remote.checksum() == engine.checksum() == weights_checksum(core.params)
    assert remote.release()["success"]
    assert _post(engine.http_url + "/health_generate", None, method="GET")[0] == 503
    with pytest.raises(EngineStateError):
        remote.generate(make_request(adapter, PROMPTS[:1], IDS[:1]))
    assert remote.resume()["success"]
    assert _post(engine.http_url + "/health_generate", None, method="GET")[0] == 200


def test_update_weights_from_disk_over_http(served, tmp_path):
    from ipc import weights_checksum

    engine, adapter, model_dir = served
    remote = SGLangEngineClient(engine.http_url)
    request = make_request(adapter, PROMPTS[:2], IDS[:2])
    before = remote.generate(request)
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02)
    model.save_pretrained(tmp_path / "transformer")
    try:
        assert remote.update_weights_from_disk(str(tmp_path))["success"]
        assert remote.checksum() == weights_checksum(dict(model.named_parameters()))
        assert not torch.equal(remote.generate(request)["images"], before["images"])
        with pytest.raises(EngineRequestError, match="no \\*.safetensors"):
            remote.update_weights_from_disk(str(tmp_path / "empty"))
    finally:
        remote.update_weights_from_disk(str(model_dir))


def _sglang_output(steps: int, seed: int, *, env: bool = True) -> dict:
    """One per-output entry as SGLang 0.5.23 answers it (tensors already decoded)."""
    out = {"request_id": "r", "prompt": "p", "seed": seed,
           "generated_output": torch.rand(3, 16, 16),
           "rollout_log_probs": torch.randn(steps),
           "dit_trajectory": {"latents": torch.randn(steps + 1, 4, 8),
                              "timesteps": torch.linspace(1000, 0, steps + 1),
                              "sigmas": torch.linspace(1, 0, steps + 1)},
           "denoising_env": None}
    if env:
        tokens = 3 + seed % 2
        # SGLang sends no mask when every token is real (a one-prompt request); test both forms
        mask = torch.ones(tokens, dtype=torch.bool) if seed % 2 else None
        # the embeddings as SGLang's denoising stage keeps batch.prompt_embeds: a list with
        # one tensor per text encoder
        out["denoising_env"] = {"image_kwargs": None, "neg_cond_kwargs": None, "guidance": None,
                                "pos_cond_kwargs": {"encoder_hidden_states": [torch.randn(tokens, 6)],
                                                    "encoder_hidden_states_mask": mask,
                                                    "txt_seq_lens": [tokens]}}
    return out


def test_sglang_answers_map_onto_our_schema():
    """[T+1] chains sliced into SDE pairs, [T] log-probs picked, [T+1] timesteps cut to T,
    pos_cond_kwargs renamed (and padded) per family, float images -> uint8."""
    from trainer.engine.sglang.rollout import (SGLangResponseError, to_schema_response,
                                               to_sglang_requests)

    steps, sde = 5, [1, 3]
    request = {"prompt": ["a", "b"], "seed": 9, "width": 16, "height": 16,
               "num_inference_steps": steps,
               "guidance_scale": 1.0, "rollout_sde_type": "sde", "rollout_noise_level": 0.7,
               "rollout_sde_step_indices": sde,
               "extra_sampling_params": {"sample_ids": ["s0", "s1"], "group_index": [0, 1],
                                         "model_family": "qwen_image"}}
    bodies = to_sglang_requests(request)
    assert [b["prompt"] for b in bodies] == ["a", "b"]
    assert all(b["num_outputs_per_prompt"] == 1 and "extra_sampling_params" not in b
               for b in bodies)
    answers = [[_sglang_output(steps, b["seed"])] for b in bodies]
    out = to_schema_response(answers, bodies, request)
    lat = out["dit_trajectory"]["latents"]
    assert lat.shape == (2, 2, 2, 4, 8)
    for b in range(2):
        chain = answers[b][0]["dit_trajectory"]["latents"]
        for k, i in enumerate(sde):
            assert torch.equal(lat[b, k, 0], chain[i]) and torch.equal(lat[b, k, 1], chain[i + 1])
            assert out["rollout_log_probs"][b, k] == answers[b][0]["rollout_log_probs"][i]
    assert out["dit_trajectory"]["timesteps"].shape == (steps,)
    env = out["denoising_env"]
    assert set(env) == {"prompt_embeds", "prompt_embeds_mask"}
    assert env["prompt_embeds"].shape[0] == 2 and env["prompt_embeds_mask"].dtype == torch.long
    lengths = [3 + b["seed"] % 2 for b in bodies]
    assert env["prompt_embeds_mask"].sum(dim=1).tolist() == lengths  # padding masked out
    assert {b["seed"] % 2 for b in bodies} == {0, 1}, "both mask forms must be exercised"
    assert out["images"].dtype == torch.uint8 and out["images"].shape == (2, 16, 16, 3)
    assert torch.equal(out["images"][0], (answers[0][0]["generated_output"].permute(1, 2, 0)
                                          * 255).round().to(torch.uint8))

    bad = [[_sglang_output(steps, bodies[0]["seed"] + 1)],
           [_sglang_output(steps, bodies[1]["seed"], env=False)] * 2]
    with pytest.raises(SGLangResponseError) as info:
        to_schema_response(bad, bodies, request)
    text = str(info.value)
    assert "candidate 0 (s0): seed" in text and "expected a list of 1 output, got 2" in text
    two_encoders = [[_sglang_output(steps, b["seed"])] for b in bodies]
    pos = two_encoders[0][0]["denoising_env"]["pos_cond_kwargs"]
    pos["encoder_hidden_states"] = pos["encoder_hidden_states"] * 2
    with pytest.raises(SGLangResponseError, match="encoder_hidden_states holds "
                       r"\['Tensor', 'Tensor'\], expected one tensor"):
        to_schema_response(two_encoders, bodies, request)
    with pytest.raises(ValueError, match="stock SGLang rejects"):
        to_sglang_requests({**request, "extra_sampling_params": {
            **request["extra_sampling_params"], "sigmas": [1.0, 0.0]}})


def test_wire_decodes_both_tensor_tags():
    """Our blobs and SGLang's ({"__tensor__": true, ...}) carry the same safetensors payload."""
    import base64

    from safetensors.torch import save

    from trainer.models.wire import from_wire, to_wire

    t = torch.randn(3, 5).to(torch.bfloat16)
    ours = to_wire({"a": [t]})
    sglang = {"__tensor__": True, "data": base64.b64encode(save({"t": t})).decode(),
              "shape": [3, 5], "dtype": "torch.bfloat16"}
    assert torch.equal(from_wire(ours)["a"][0], t)
    assert torch.equal(from_wire({"x": sglang})["x"], t)
    assert json.loads(json.dumps(ours)) == ours  # plain JSON types only


def test_preflight_names_what_stock_sglang_cannot_do():
    from trainer.config import ConfigError, load_config
    from trainer.preflight import preflight

    cfg = load_config("tiny", ["rollout.engine=sglang",
                               'rollout.sglang_urls=["http://127.0.0.1:9"]',
                               'rollout.sampling={"sde_type": "dance", "driver_sigmas": true}',
                               "rollout.sglang_weight_sync=ftp", "rollout.sglang_concurrency=0"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, world_size=1, device="cpu", check_paths=False)
    text = str(info.value)
    for fragment in ("sde_type='dance'", "sampling.driver_sigmas is on", "sampling.driver_xt is on",
                     "sglang_weight_sync must be 'tensor' or 'disk'",
                     "sglang_concurrency must be a positive integer"):
        assert fragment in text, fragment
    assert ("model family 'toy': the SGLang client maps the denoising env of "
            "['flux', 'qwen_image', 'qwen_image_edit', 'qwen_image_edit_plus', 'sd3', 'wan', "
            "'wan_i2v']") in text  # the tiny recipe's toy adapter
    qwen = "model.adapter_path=trainer.models.qwen_image.QwenImageAdapter"
    ok = load_config("tiny", ["rollout.engine=sglang", 'rollout.sglang_urls=["http://127.0.0.1:9"]',
                              'rollout.sampling={"driver_sigmas": false, "driver_xt": false}', qwen])
    preflight(ok, world_size=1, device="cpu", check_paths=False)
    for family in ("sd3", "flux"):  # served natively too (tests/test_sglang_families.py)
        other = load_config("tiny", ["rollout.engine=sglang",
                                     'rollout.sglang_urls=["http://127.0.0.1:9"]',
                                     'rollout.sampling={"driver_sigmas": false, '
                                     '"driver_xt": false}',
                                     f"model.adapter_path=trainer.models.{family}."
                                     f"{'SD3Adapter' if family == 'sd3' else 'FluxAdapter'}"])
        preflight(other, world_size=1, device="cpu", check_paths=False)
    # the extension takes the driver's sigmas, x_T and noise, and dance (on the driver's noise)
    urls = ["rollout.engine=sglang", 'rollout.sglang_urls=["http://127.0.0.1:9"]',
            "rollout.sglang_extension=true", qwen]
    preflight(load_config("tiny", urls + ['rollout.sampling={"sde_type": "dance", '
                                          '"driver_sigmas": true, "driver_xt": true}']),
              world_size=1, device="cpu", check_paths=False)
    with pytest.raises(ConfigError, match="sde_type='dance' runs on the extension's sampler"):
        preflight(load_config("tiny", urls + ['rollout.sampling={"sde_type": "dance", '
                                              '"driver_xt": false}']),
                  world_size=1, device="cpu", check_paths=False)
    adapter_mode = ["lora.rank=4", "fsdp.trainable_mode=lora", "lora.adapter_mode=true"]
    with pytest.raises(ConfigError, match="SGLang's lora_merge takes an integer lora_alpha"):
        preflight(load_config("tiny", urls + adapter_mode + ["lora.alpha=8.5"]),
                  world_size=1, device="cpu", check_paths=False)
    preflight(load_config("tiny", urls + adapter_mode + ["lora.alpha=8"]),
              world_size=1, device="cpu", check_paths=False)


def test_ci_and_readme_install_the_pinned_sglang():
    """CI runs exactly the README's test command, which installs the pinned SGLang without
    its dependencies (they would replace torch) after the pure-Python ones it imports."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().splitlines()
    command = readme[readme.index(next(line for line in readme if line.startswith("# 2."))) + 1]
    ci = [line for line in (root / ".ci/run").read_text().splitlines() if "pytest" in line]
    assert ci == [command]
    assert "-r tests/requirements-sglang.txt" in command
    assert "pip install --no-deps -c constraints.txt sglang==0.5.23" in command
