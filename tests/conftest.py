import json
import os
import sys

import pytest
import torch

# Triton kernels run on the CPU through the interpreter when there is no GPU;
# it must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

import factory  # noqa: E402


def _interpret_without_nested_lang_patches():
    """Under the Triton interpreter every call of a ``@triton.jit`` helper from a kernel
    re-patches ``triton.language`` (a scan of all its members), though the kernel's launch
    has patched the same modules and restores them when it ends. Within a launch, a helper
    whose modules the launch patched skips the re-patch; everything else goes through Triton
    unchanged. About a fifth of an interpreted kernel's time; the same numbers."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    patch, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or scope_type is None or executor is None:  # another Triton: left as it is
        return
    run = executor.__call__
    launch = threading.local()  # the launch running on this thread: its modules, patched yet

    langs = {}

    def langs_of(fn) -> set[int]:
        if fn not in langs:
            langs[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return langs[fn]

    def call(self, *args, **kwargs):
        launch.langs, launch.patched = langs_of(self.fn), False
        try:
            return run(self, *args, **kwargs)
        finally:
            launch.langs = None

    def patch_once(fn):
        patched = getattr(launch, "langs", None)
        if patched is not None and launch.patched and langs_of(fn) <= patched:
            return scope_type()  # a helper inside the launch: patched already
        scope = patch(fn)
        launch.patched = patched is not None
        return scope

    executor.__call__ = call
    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_without_nested_lang_patches()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "examples", "demo")


DEMO_MAX_NEW_TOKENS = 40  # the scale-out tests' reference job (demo_job_options)


def demo_job_options(out, **kw):
    """``JobConfig`` of the demo job on the CPU in float32 (40 new tokens, 7-row shards, the
    prompt column kept), written to ``out``: the configuration the scale-out tests (worker
    processes, Ray) compare with one process; ``kw`` overrides any field. Shards are cut by
    rows alone (a commit interval of an hour), so their bytes compare even on a slow host."""
    from mlora.batch.config import JobConfig

    base = dict(input=os.path.join(DEMO, "prompts.parquet"), output=str(out), base=os.path.join(DEMO, "base"),
                adapters_dir=os.path.join(DEMO, "adapters"), max_new_tokens=DEMO_MAX_NEW_TOKENS, device="cpu",
                dtype="float32", shard_rows=7, commit_interval=3600.0, keep_columns=("prompt",))
    base.update(kw)
    return JobConfig(**base)


def shard_digests(out) -> list[str]:
    """The SHA-256 of every shard a batch-run output's manifest lists, in order."""
    with open(os.path.join(out, "_manifest.json")) as f:
        return [s["sha256"] for s in json.load(f)["shards"]]


@pytest.fixture(scope="session")
def single_process_output(tmp_path_factory):
    """The demo job's output from one process (:func:`demo_job_options`), run once per session
    and only read by the tests (one torch thread: a busy 2-core host slows multi-threaded
    tiny CPU ops by an order of magnitude)."""
    from mlora.batch.runner import run_job

    out = tmp_path_factory.mktemp("single") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_job(demo_job_options(out))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    """A tiny Llama base checkpoint (single safetensors file)."""
    path = str(tmp_path_factory.mktemp("base") / "tiny-llama")
    factory.save_base(factory.tiny_model("llama"), path)
    return path


@pytest.fixture(scope="session")
def good_adapter(tmp_path_factory, base_dir):
    """A valid, servable PEFT adapter on q_proj and v_proj, r=4, over ``base_dir``'s model."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("adapters") / "good")
    factory.make_adapter(path, base_model=AutoModelForCausalLM.from_pretrained(base_dir), r=4, lora_alpha=8)
    cfg = factory.read_config(path)
    cfg["base_model_name_or_path"] = "org/tiny-llama"
    factory.write_config(path, cfg)
    return path


@pytest.fixture
def adapter_copy(tmp_path, good_adapter):
    """A private, writable copy of ``good_adapter`` to mutate."""
    return factory.copy_adapter(good_adapter, str(tmp_path / "mutant"))


@pytest.fixture
def run_cli():
    """Invoke the CLI in-process; returns (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from mlora.cli.app import app

    def run(*args):
        result = CliRunner().invoke(app, [str(a) for a in args])
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.stdout, result.stderr

    return run


@pytest.fixture
def manifests(run_cli):
    """Run ``mlora validate --json`` and return (exit_code, [manifest, ...])."""

    def run(*args):
        code, out, _ = run_cli("validate", "--json", *args)
        return code, [json.loads(line) for line in out.splitlines()]

    return run


def codes(manifest: dict) -> set[str]:
    return {f["code"] for f in manifest["findings"]}
