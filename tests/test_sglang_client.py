"""HTTP mode of the embedded engine through ``SGLangEngineClient``: schema round trip in both
request forms (batched, and SGLang's single-prompt list form), 4xx with every problem named,
state endpoints, weight reload from disk, and merging SGLang-style per-output answers."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from engine_fixtures import ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir, make_request
from trainer.engine import (EngineRequestError, EngineStateError, SGLangEngineClient,
                            launch_embedded_engine)
from trainer.engine.sglang_client import merge_outputs

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


@pytest.mark.parametrize("batch_prompts", [None, False])
def test_schema_round_trip_equals_in_process(served, batch_prompts):
    engine, adapter, _ = served
    request = make_request(adapter, PROMPTS, IDS)
    remote = SGLangEngineClient(engine.http_url, batch_prompts=batch_prompts)
    via_http = remote.generate(request)
    if batch_prompts is False:  # one request per group: compare with the same batches in-process
        parts = [engine.generate(make_request(adapter, PROMPTS[i:i + 2], IDS[i:i + 2]))
                 for i in (0, 2)]
        direct = {**parts[0], "sample_ids": IDS,
                  **{k: torch.cat([p[k] for p in parts]) for k in ("rollout_log_probs", "images")},
                  "dit_trajectory": {**parts[0]["dit_trajectory"], "latents": torch.cat(
                      [p["dit_trajectory"]["latents"] for p in parts])},
                  "denoising_env": {k: torch.cat([p["denoising_env"][k] for p in parts])
                                    for k in parts[0]["denoising_env"]}}
    else:
        direct = engine.generate(request)
    _assert_same_response(direct, via_http)
    adapter.validate_rollout_response(via_http, request)
    # auto-detection: the embedded engine identifies itself, so one batched POST is used
    assert remote.batch_prompts is (batch_prompts is not False)


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
    bad = dict(good, height=33, guidance_scale=7.5, rollout_sde_step_indices=[5, 2],
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


def test_merge_outputs_slices_sglang_full_chains():
    """A stock SGLang answer: one entry per output, the full [N+1] chain, per-step log-probs."""
    steps, sde = 5, [1, 3]
    chain = [torch.randn(steps + 1, 4, 16) for _ in range(2)]
    logp = [torch.randn(steps) for _ in range(2)]
    entries = [{"request_id": f"r-{b}", "prompt": "p", "seed": 3, "sample_id": f"s{b}",
                "generated_output": torch.full((8, 8, 3), b, dtype=torch.uint8),
                "rollout_log_probs": {"log_probs": logp[b]},
                "dit_trajectory": {"latents": chain[b], "timesteps": torch.arange(steps) * 1.0,
                                   "sigmas": torch.linspace(1, 0, steps + 1)},
                "denoising_env": {"pos_cond_kwargs": {"prompt_embeds": torch.ones(3, 2) * b}},
                "sde_indices": sde, "height": 8, "width": 8} for b in range(2)]
    merged = merge_outputs(entries, {"rollout_sde_step_indices": sde})
    assert merged["sample_ids"] == ["s0", "s1"]
    assert merged["dit_trajectory"]["latents"].shape == (2, 2, 2, 4, 16)
    for b in range(2):
        for k, i in enumerate(sde):
            assert torch.equal(merged["dit_trajectory"]["latents"][b, k, 0], chain[b][i])
            assert torch.equal(merged["dit_trajectory"]["latents"][b, k, 1], chain[b][i + 1])
            assert merged["rollout_log_probs"][b, k] == logp[b][i]
    assert merged["images"].shape == (2, 8, 8, 3)
    assert torch.equal(merged["denoising_env"]["prompt_embeds"][1], torch.ones(3, 2))


def test_wire_decodes_both_tensor_tags():
    """Our blobs and SGLang's ({"__tensor__": true, ...}) carry the same safetensors payload."""
    import base64

    from safetensors.torch import save

    from trainer.engine.wire import from_wire, to_wire

    t = torch.randn(3, 5).to(torch.bfloat16)
    ours = to_wire({"a": [t]})
    sglang = {"__tensor__": True, "data": base64.b64encode(save({"t": t})).decode(),
              "shape": [3, 5], "dtype": "torch.bfloat16"}
    assert torch.equal(from_wire(ours)["a"][0], t)
    assert torch.equal(from_wire({"x": sglang})["x"], t)
    assert json.loads(json.dumps(ours)) == ours  # plain JSON types only
