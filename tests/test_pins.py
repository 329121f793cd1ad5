"""Known values that must never change: the identities of the embedded demo workspace and the
per-row sampling stream.

Every other identity test compares two digests computed by the same code, so a change of the
canonical form, a digest formula or the tensor-digest prefix would pass them all. These values
were computed once (mlora at the commit that added this file) and are pinned here because they
are stored outside the code: catalogs pin ``artifact_sha256``, output rows carry
``adapter_sha256`` (the semantic digest), job fingerprints hold ``base_sha256`` and the
adapters' semantic digests, releases and bundles name their parents by them. A changed value
here means every stored digest stops matching and every ``--resume`` of an existing job is
refused. Likewise the sampling stream: a row's sampled tokens depend only on (seed, row id,
token index), and a resumed sampled job relies on drawing the same numbers as the run that
started it. Change a value only with a deliberate, documented format change (docs/identity.md).
"""

import os

import pytest
import torch
from conftest import DEMO

from mlora.batch.engine.sampling import SamplingParams, row_key, sample, uniform
from mlora.lora_tools.base import BaseCheckpoint
from mlora.lora_tools.safetensors_io import tensor_sha256

BASE = os.path.join(DEMO, "base")
ADAPTERS = os.path.join(DEMO, "adapters")

DEMO_BASE = {
    "model_weights_sha256": "bf33e31fc2e7054f0676640eb51d97d604c8bfd147032e7cf8064a21be403fde",
    "model_config_sha256": "2db54fbfbd0b2d4e7709c1cfcbe47093303fd49bc17a1db6231c97e9dc14accd",
    "weight_transform_sha256": "fe60f8ccc99b53a69c422fb8541c07c875d6d565b4097824f61fbeb4360f9be9",
    "target_module_map_sha256": "7c8cb44e2a6206baa89c1a33e34d067ebb327036fb9dd7ca185db61f1fa87eb5",
    "base_sha256": "ff5fd54a131f0b77997bae48a06d94defba36313a823d9ab9f59db518e42371a",
}

ALWAYS_ON = "0ae740c4fcd4a3d3c0d1e9eca48b0b192e27f13190d855b8088734255f76c056"  # digest({"kind": "always_on"})
PLAIN_CONFIG = "dd74d6afff9fdec113f5c0755a3aae5092121b47956ff45381d69bd1bc28047c"  # the defaults' projection
# name: (peft_config_sha256, artifact_sha256, semantic_sha256 with the demo base measured, ... declared)
DEMO_ADAPTERS = {
    "reverse": (PLAIN_CONFIG, "bb9f2660e98119a4ac92a1ac4351c9dc56c69eda626508f8f8f8718a33fc07ba",
                "9107a4a032fd5decee65ca805ce9b5bb0a0bfc7440caef7dd93bfb26a5ae5c9a",
                "bed05932d52ce9996c5f8b5957212acb8cbd61f9f05b41b4147ba459f787f3a4"),
    "rot13": ("df8ddb193dcc20ce8133a942839a1b42e5ea863070f0ee5cb23b8bda6ba9b7fb",  # use_rslora
              "72dbd7f368a7737ccd73651c45171237bb513f2d54f51f09ed219013a9f2eb0b",
              "a7f5d599f81f6568d49defedc6eb27f50e9ff3f5b2d4a9f375255708f1207542",
              "24e4ea20a9b100370c96701a110af9fca5457a8a2e3878566f627dc7a762b42f"),
    "spell": (PLAIN_CONFIG, "8dd11799b638b1a6e3da8e25e68754b10f67e529e0f1d3995b9c33f7728b02cf",
              "e29aad1cdb93edf125a737987fb0aef8702f7a0ad21fc25f6d0465a8ac94cd36",
              "567f774fc37a73c6df5672616eecb66daecac715c1db60ebc06c4b1a4f0a9dc7"),
    "upper": (PLAIN_CONFIG, "e2ce6db804655cd8ef42d44bf6745bd94a6bb90cfdfc97b35c8df98502b12fbc",
              "883167c186c91bad575dd57cc8e48aafa82e13d67aff7950ef3b575a212f002a",
              "7cdcbb3de9706fd0320e437835e8494098d49b5b15630263e353acc4f13fe1fe"),
}


def test_tensor_digest_of_known_bytes():
    assert tensor_sha256("F32", [2, 3], bytes(range(24))) == (
        "bfc5a6b78d6823487cc2fe04e2082837d3036703c2afc91d84d2171376579f1a")


def test_demo_base_identity():
    assert BaseCheckpoint(BASE).identity(workers=1).to_json() == DEMO_BASE


@pytest.mark.parametrize("binding", ["measured", "declared"])
def test_demo_adapter_identities(manifests, binding):
    rc, ms = manifests(ADAPTERS, *(["--base", BASE] if binding == "measured" else []))
    assert rc == 0
    got = {m["name"]: (m["peft_config_sha256"], m["artifact_sha256"], m["semantic_sha256"]) for m in ms}
    col = 2 if binding == "measured" else 3
    assert got == {name: (v[0], v[1], v[col]) for name, v in DEMO_ADAPTERS.items()}
    assert {m["activation_policy_sha256"] for m in ms} == {ALWAYS_ON}
    if binding == "measured":
        assert {m["base"]["base_sha256"] for m in ms} == {DEMO_BASE["base_sha256"]}


def test_per_row_sampling_stream():
    assert row_key(0, "r0") == 9685827912537069554
    assert row_key(7, "row-3") == 7089167249210085225
    assert [uniform(row_key(0, "r0"), i) for i in range(5)] == [
        0.7001985615849496, 0.9377351151930906, 0.8843806178681682, 0.8205829469631587, 0.486719120207981]
    assert [uniform(row_key(7, "row-3"), i) for i in range(5)] == [
        0.45419876316895724, 0.3613315720481173, 0.5519817365189227, 0.16818054589039133, 0.6675678922715357]
    logits = torch.arange(16, dtype=torch.float32).reshape(2, 8) / 4
    assert sample(logits, SamplingParams(temperature=1.0, seed=3), [row_key(3, "a"), row_key(3, "b")], [0, 5]) == [4, 1]
