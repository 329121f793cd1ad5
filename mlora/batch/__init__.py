"""The offline batch engine behind ``mlora batch-run`` (spec 0x01-0x05, 0x09; docs/batch.md).

Entry point: :func:`mlora.batch.job.prepare.run_job`. Modules: ``io`` (Parquet input),
``catalog`` (adapters pinned by digest), ``engine`` (continuous batching,
adapter-aware admission), ``model`` / ``attention`` / ``kvcache`` (the
decoder), ``residency`` (the adapter residency engine and its slot bank),
``bank`` (step 3's simple slot bank, the reference for the residency bank),
``lora`` (the model seam), ``sampling``, ``metrics``, ``output`` (atomic
shards, manifest, resume), ``session`` (one engine on one device), and the
scale-out (docs/scaleout.md): ``placement`` (--gpus / --num-workers /
--engine), ``assign``, ``multi`` and ``worker`` (the coordinator and its
worker processes), ``ray`` (Ray Data and ``MloraPredictor``); on a GPU
``paged_attention`` (Triton), ``graphs`` (CUDA graphs for decode steps) and
``fused`` (element-wise kernels); ``bundles`` / ``bundle_bank`` (compressed
collection members); the ``bench*`` modules behind ``mlora bench``.
"""
