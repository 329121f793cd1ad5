"""The AdapterBank protocol (mlora.batch.adapters.protocol): every bank the engine serves from
implements all of it, and a bank whose loads happen inside ``ensure`` answers the other hooks
as no-ops."""

import torch
from test_bundle_serving import served  # noqa: F401  (the bundle fixture)

from mlora.batch.adapters.bundle_bank import BundleBank
from mlora.batch.adapters.protocol import AdapterBank
from mlora.batch.adapters.residency import ResidencyBank
from mlora.batch.adapters.residency.manager import PER_LOAD_STATS
from mlora.bench.batch import preset_config, random_bank, random_model
from mlora.kernels import LaunchPlan


def _slot_bank(backend="auto"):
    model = random_model(preset_config("tiny", "float32"), torch.device("cpu"), torch.float32, seed=1)
    return model, *random_bank(model, 2, 4, seed=1, backend=backend)


def test_a_slot_bank_answers_the_load_ahead_hooks_as_no_ops():
    _, bank, pinned = _slot_bank()
    assert isinstance(bank, AdapterBank) and not bank.loads_ahead and bank.arena is None and bank.residency is None
    resident = dict(bank.resident)
    assert bank.start_load("bench-0", pinned) == "sync"
    assert bank.prefetch(["bench-1"], pinned) == 0 and bank.prefetch_device(["bench-1"], pinned, 4) == 0
    assert bank.commit_device() == [] and bank.loads_in_flight() == 0 and bank.prefetch_counts() == (0, 0)
    bank.acquire("row0", "bench-0", pinned)
    bank.want(["bench-1"], pinned)
    bank.release("row0")
    bank.end_invocation()
    assert bank.resident == resident and bank.source_tier("bench-0", pinned) == "disk"
    assert bank.report() == bank.stats.as_dict() == {"hits": 0, "misses": 0, "loads": 0, "evictions": 0}


def test_a_slot_banks_graph_lora_is_a_static_launch_plan_over_every_group():
    _, bank, _ = _slot_bank("triton")  # the graphs' backend (the Triton kernels read the static plan)
    lora = bank.graph_lora(4)
    assert isinstance(lora.static, LaunchPlan) and lora.static.row_capacity == 4 and int(lora.static.num_tiles) == 0
    assert lora.context.targeted == {(layer, g) for layer in range(bank.num_layers) for g in bank.groups}
    bank.context(torch.tensor([1, -1, 0, -1], dtype=torch.int32), static=lora.static)  # refilled in place
    assert int(lora.static.num_tiles) == 2


def test_a_residency_bank_is_an_adapter_bank_that_loads_ahead():
    model = random_model(preset_config("tiny", "float32"), torch.device("cpu"), torch.float32, seed=2)
    bank = ResidencyBank(model.config.num_layers, model.group_shapes(), 2, 4, torch.float32, "cpu", prefetch_workers=0)
    try:
        assert isinstance(bank, AdapterBank) and bank.loads_ahead and bank.residency is not None
        assert bank.prefetch_counts() == (0, 0)
        report = bank.report()
        assert report["loads_started_ahead"] == 0 and report["loads"] == 0
        assert not set(report) & set(PER_LOAD_STATS)  # per-load timings are summarised, not listed
        assert isinstance(bank.graph_lora(2).static, LaunchPlan)
    finally:
        bank.close()


def test_a_bundle_bank_is_an_adapter_bank_whose_graph_lora_reads_a_row_buffer(served):  # noqa: F811
    bundle, pinned, shapes, layers = served
    bank = BundleBank(bundle, layers, shapes, torch.float32, "cpu", pinned=pinned)
    assert isinstance(bank, AdapterBank) and not bank.loads_ahead
    assert bank.start_load(next(iter(pinned)), pinned) == "sync" and bank.report() == bank.stats.as_dict()
    lora = bank.graph_lora(3)
    assert lora.static.tolist() == [bank.num_slots] * 3  # every row the base model's zero core until refilled
    bank.context(torch.tensor([0, -1, 1], dtype=torch.int32), static=lora.static)
    assert lora.static.tolist() == [0, bank.num_slots, 1]
