"""The offline batch engine behind ``mlora batch-run`` (spec 0x01-0x03; docs/batch.md).

Entry point: :func:`mlora.batch.job.run_job`. Modules: ``io`` (Parquet input),
``catalog`` (adapters pinned by digest), ``engine`` (continuous batching),
``model`` / ``attention`` / ``kvcache`` (the decoder), ``bank`` + ``lora``
(adapter slots and the model seam), ``sampling``, ``output`` (atomic shards,
manifest, resume). Not built yet: GPU attention kernels, CUDA graphs,
``mlora bench batch`` (step 3 GPU work), the residency engine (step 4).
"""
