"""mlora inside your own Ray Data pipeline: the demo prompts through MloraPredictor.

    pip install 'mlora[ray]'
    python examples/ray_pipeline.py                      # CPU, a local Ray instance, 2 actors
    python examples/ray_pipeline.py --address auto       # an existing cluster (one GPU per actor there)

What it shows (docs/scaleout.md, "Your own Ray pipeline"):

1. Pin the adapters once on the driver (``pin_adapters``: validated and hashed
   once; every actor then serves exactly these identities).
2. Read Parquet with Ray Data, sort by adapter so each actor sees
   adapter-coherent batches, and ``map_batches`` with ``MloraPredictor``: one
   mlora engine per actor, constructed once and reused for every batch.
3. Keep your own columns (``prompt`` here) next to mlora's output columns,
   and write the result wherever you like. Unlike ``mlora batch-run --engine
   ray``, this writes no ``_manifest.json``, has no ``--resume`` and keeps no
   input order: the pipeline is yours.
"""

from __future__ import annotations

import argparse
import os

import ray
import ray.data

from mlora.batch.scaleout.ray import MloraPredictor, pin_adapters

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", default=None, help="Ray cluster address (default: start a local instance)")
    ap.add_argument("--actors", type=int, default=2, help="mlora engines (Ray actors)")
    ap.add_argument("--gpus-per-actor", type=float, default=0, help="1 on a GPU cluster")
    ap.add_argument("--output", default=None, help="also write the result as Parquet into this directory")
    args = ap.parse_args(argv)

    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address, include_dashboard=False)
    try:
        base, adapters = os.path.join(DEMO, "base"), os.path.join(DEMO, "adapters")
        pinned = pin_adapters(base, adapters)  # once, on the driver

        ds = ray.data.read_parquet(os.path.join(DEMO, "prompts.parquet"))
        # adapter-coherent batches: rows of one adapter next to each other (None = the base model)
        ds = ds.map_batches(lambda t: t.append_column("adapter_key", t.column("adapter").fill_null("")),
                            batch_format="pyarrow").sort("adapter_key").drop_columns(["adapter_key"])
        # sort fully before the actors take the CPUs (on a small CPU host they would starve the sort)
        ds = ds.materialize()
        on_gpu = args.gpus_per_actor > 0
        out = ds.map_batches(
            MloraPredictor,
            fn_constructor_kwargs=dict(base=base, pinned=pinned, device="cuda" if on_gpu else "cpu",
                                       max_new_tokens=40, max_num_seqs=64, torch_threads=None if on_gpu else 1),
            batch_size=16, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=args.actors),
            num_gpus=args.gpus_per_actor, num_cpus=1,
        )
        if args.output:
            out.write_parquet(args.output)
            out = ray.data.read_parquet(args.output)
        rows = sorted(out.take_all(), key=lambda r: r["id"])
    finally:
        if started:
            ray.shutdown()
    for r in rows[:10]:
        prompt = r["prompt"].removeprefix("<|bos|>").removesuffix("=")
        print(f"{r['adapter'] or '(base)':<10} {prompt:<16} {r['completion']}")
    print(f"... {len(rows)} rows; columns: {', '.join(rows[0])}")
    return rows


if __name__ == "__main__":
    main()
