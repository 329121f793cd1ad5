"""The offline batch engine behind ``mlora batch-run`` (docs/design.md, Inside ``mlora.batch``).

Entry point: :func:`mlora.batch.runner.run_job`. Rooms, top to bottom; a module
imports only from its own room and those below it (pyproject.toml's contracts):

    runner      run_job: validates the config, then runs the job here, in worker processes or on Ray
    scaleout    placement (--gpus / --num-workers / --engine), assign, coordinator and worker, ray
    job         input (Parquet), output (shards, manifest, resume), prepare, session (one engine
                on one device), sizing, metrics
    engine      continuous batching: engine, waiting, sampling, graphs (CUDA graphs of decode), joint
    adapters    catalog (adapters pinned by digest), slots, residency, bundles, bundle_bank
    model       decoder, attention, kvcache, lora (the LoRA seam), gemms, arena, tp and tpgroup
                (tensor parallelism: the layout, the rank processes)
    config, errors, gcpauses    shared by every room

The engine never reads adapter files (it asks the adapters room for slots); the
model never knows where factors live. GPU kernels live in :mod:`mlora.kernels`,
the ``mlora bench`` drivers in :mod:`mlora.bench`.
"""
