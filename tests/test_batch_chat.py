"""`batch-run --messages-column`: chat messages rendered with the base's own chat template.

The rendering and tokenization must equal transformers' `apply_chat_template(...,
add_generation_prompt=True, tokenize=True)` token for token (a tokenizer whose post-processor adds
BOS, so adding special tokens twice would show); a job over a messages column must write what the
same job writes from the rendered token ids; a base without a template fails before any row runs;
a bad row fails alone with its code.
"""

import json
import os
import shutil

import factory
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DEMO

from mlora.batch.errors import JobError
from mlora.batch.job.chat import ChatMessagesError, load_chat_template
from mlora.batch.job.input import InputSpec, JobInputError, open_input
from mlora.batch.job.prepare import Tokenizer

# Llama-3 style: BOS from the template, a default system turn, strict alternation, raise_exception
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = 'You are a helpful assistant.' %}
    {%- set turns = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in turns %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('role ' + message['role'] + ' is neither user nor assistant') }}
    {%- endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('turns must alternate user / assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ChatML style without whitespace control: trim_blocks and lstrip_blocks decide every newline
CHATML = """{% set ns = namespace(users=0) %}
{% for message in messages %}
  {% if message.role not in ('system', 'user', 'assistant') %}
    {{ raise_exception('unknown role: ' ~ message.role) }}
  {% endif %}
  {% if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}

{{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant [turn {{ ns.users }}]
{% endif %}"""

# loop controls, tojson, eos_token (an AddedToken object in the config) and a {% generation %} block
MARKED = """{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content | tojson }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and <b>3+3</b> & ünïcode ✓ 'q' \"qq\""}],
    [{"role": "user", "content": "line one\n\n  line two\t<|eot_id|> literal"}],
    [{"role": "user", "content": "hi", "name": "ann"}],
    [{"role": "user", "content": "no name", "name": None}],  # a null field is dropped, as transformers drops it
]


def _reference(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _apply(ref, conv, tokenize=True):
    return ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=tokenize, return_dict=False)


@pytest.mark.parametrize("template", [LLAMA3, CHATML, MARKED], ids=["llama3", "chatml", "marked"])
def test_encode_chat_is_token_exact_with_transformers(tmp_path, template):
    path = factory.save_chat_tokenizer(str(tmp_path / "tok"), chat_template=template)
    ours, ref = Tokenizer(path, chat=True), _reference(path)
    for conv in CONVERSATIONS:
        text = _apply(ref, conv, tokenize=False)
        assert ours.chat_template.render(conv) == text
        expected = _apply(ref, conv)
        assert ours.encode_chat(conv) == expected
        assert ours.encode(text) != expected  # the post-processor's BOS: special tokens must not be added again
    if template is LLAMA3:
        assert expected[0] == ours._tok.token_to_id("<|begin_of_text|>") and expected.count(expected[0]) == 1


def test_template_sources_follow_transformers(tmp_path):
    # chat_template.jinja beside the config wins over the config's chat_template
    both = factory.save_chat_tokenizer(str(tmp_path / "both"), chat_template=CHATML, template_file=LLAMA3)
    # a list of named templates: the one called default
    named = factory.save_chat_tokenizer(str(tmp_path / "named"), chat_template=[
        {"name": "tool_use", "template": CHATML}, {"name": "default", "template": LLAMA3}])
    for path in (both, named):
        assert load_chat_template(path).source == LLAMA3
        ref = _reference(path)
        for conv in CONVERSATIONS:
            assert Tokenizer(path, chat=True).encode_chat(conv) == _apply(ref, conv)


@pytest.mark.parametrize("template, code", [
    (None, "E_CHAT_TEMPLATE_MISSING"), ("", "E_CHAT_TEMPLATE_MISSING"),
    ([{"name": "tool_use", "template": CHATML}], "E_CHAT_TEMPLATE_MISSING"),
    ("{% for m in messages %}{{ m.content }}", "E_CHAT_TEMPLATE_INVALID"),
])
def test_a_base_without_a_usable_template_fails_closed(tmp_path, template, code):
    path = factory.save_chat_tokenizer(str(tmp_path / "tok"), chat_template=template)
    with pytest.raises(JobError) as e:
        Tokenizer(path, chat=True)
    assert e.value.code == code and e.value.exit_code == 1
    Tokenizer(path)  # text prompts do not need a template


@pytest.mark.parametrize("messages, code", [
    ([], "E_PROMPT_MESSAGES"),
    ([None], "E_PROMPT_MESSAGES"),
    ("hello", "E_PROMPT_MESSAGES"),
    ([{"role": "user"}], "E_PROMPT_MESSAGES"),
    ([{"role": None, "content": "x"}], "E_PROMPT_MESSAGES"),
    ([{"role": "user", "content": 7}], "E_PROMPT_MESSAGES"),
    ([{"role": "tool", "content": "x"}], "E_PROMPT_TEMPLATE"),  # raise_exception in the template
    ([{"role": "assistant", "content": "x"}], "E_PROMPT_TEMPLATE"),
])
def test_bad_messages_have_stable_codes(tmp_path, messages, code):
    path = factory.save_chat_tokenizer(str(tmp_path / "tok"), chat_template=LLAMA3)
    with pytest.raises(ChatMessagesError) as e:
        Tokenizer(path, chat=True).encode_chat(messages)
    assert e.value.code == code
    if code == "E_PROMPT_TEMPLATE":  # transformers refuses them too
        import jinja2

        with pytest.raises(jinja2.TemplateError):
            _apply(_reference(path), messages)


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",  # the sandbox: no Python internals
    "{% set ns = namespace(_hidden=1) %}",
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
    "{{ messages.append(1) }}",  # immutable: a template cannot change its input
])
def test_templates_run_sandboxed(tmp_path, template):
    path = factory.save_chat_tokenizer(str(tmp_path / "tok"), chat_template=template)
    with pytest.raises(ChatMessagesError) as e:
        Tokenizer(path, chat=True).encode_chat(CONVERSATIONS[0])
    assert e.value.code == "E_PROMPT_TEMPLATE" and "SecurityError" in e.value.message


def test_input_spec_takes_exactly_one_prompt_source(tmp_path):
    assert InputSpec(prompt_column=None, messages_column="m").roles()["messages"] == "m"
    for kw in (dict(messages_column="m"), dict(prompt_column=None, prompt_ids_column="i", messages_column="m")):
        with pytest.raises(JobInputError) as e:
            InputSpec(**kw)
        assert e.value.code == "E_INPUT_USAGE"


# ---------------------------------------------------------------- jobs on the demo base with a template

# fits the demo's 259-token vocabulary (bytes and <|bos|>, <|eos|>, <|pad|>) and its "<|bos|>prompt=" habit
DEMO_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role not in ['system', 'user'] %}"
                 "{{ raise_exception('only system and user turns') }}{% endif %}"
                 "{% if m.role == 'system' %}[{{ m.content }}] {% else %}{{ m.content }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}={% endif %}")
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
GOOD = [
    ("r0", [{"role": "user", "content": "hello world"}], "upper"),
    ("r1", [{"role": "system", "content": "x"}, {"role": "user", "content": "abc 123"}], "reverse"),
    ("r2", [{"role": "user", "content": "lora 42"}], None),
    ("r3", [{"role": "user", "content": "zebra 2024"}], "spell"),
]


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory):
    """A copy of the demo base whose tokenizer_config.json holds :data:`DEMO_TEMPLATE`."""
    path = str(tmp_path_factory.mktemp("chat") / "base")
    shutil.copytree(os.path.join(DEMO, "base"), path)
    _set_template(path, DEMO_TEMPLATE)
    return path


def _set_template(base, template):
    cfg_path = os.path.join(base, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = template
    json.dump(cfg, open(cfg_path, "w"))


def _write(path, rows, column, type_):
    ids, values, adapters = zip(*rows)
    pq.write_table(pa.table({"id": pa.array(ids), column: pa.array(values, type_),
                             "adapter": pa.array(adapters, pa.string())}), path)
    return path


def _job(run_cli, inp, out, base, *extra):
    return run_cli("batch-run", inp, out, "--base", base, "--adapters", os.path.join(DEMO, "adapters"),
                   "--device", "cpu", "--max-new-tokens", 12, "--quiet", "--json", *extra)


def test_a_messages_job_equals_the_job_on_the_rendered_token_ids(tmp_path, chat_base, run_cli):
    ref = _reference(chat_base)
    rendered = [(rid, _apply(ref, msgs), adapter) for rid, msgs, adapter in GOOD]
    code, _, err = _job(run_cli, _write(tmp_path / "m.parquet", GOOD, "messages", MESSAGES), tmp_path / "m", chat_base,
                        "--messages-column", "messages")
    assert code == 0, err
    code, _, err = _job(run_cli, _write(tmp_path / "i.parquet", rendered, "prompt_ids", pa.list_(pa.int64())),
                        tmp_path / "i", chat_base, "--prompt-ids-column", "prompt_ids")
    assert code == 0, err
    got = pq.read_table(tmp_path / "m").to_pylist()
    want = pq.read_table(tmp_path / "i").to_pylist()
    tok = Tokenizer(chat_base)
    for g, w, (_, ids, _) in zip(got, want, rendered):
        assert g["error_code"] is None and g["num_prompt_tokens"] == len(ids)
        assert g["completion"] == tok.decode(g["completion_token_ids"])
        assert {k: v for k, v in g.items() if k != "completion"} == {k: v for k, v in w.items() if k != "completion"}
    assert any(g["completion_token_ids"] for g in got)

    # the template is part of the job: the same job under another template does not resume
    other = str(tmp_path / "other")
    shutil.copytree(chat_base, other)
    _set_template(other, DEMO_TEMPLATE.replace("%}={%", "%}: {%"))
    code, _, err = _job(run_cli, tmp_path / "m.parquet", tmp_path / "m", other, "--messages-column", "messages",
                        "--resume")
    said = " ".join(err.split())  # the message as one line, as the console wrapped it
    assert code == 1 and "E_RESUME_MISMATCH" in said and "chat_template_sha256" in said


def test_bad_message_rows_fail_alone_with_their_codes(tmp_path, chat_base, run_cli):
    rows = GOOD[:1] + [
        ("null", None, None),
        ("empty", [], None),
        ("no-content", [{"role": "user", "content": None}], None),
        ("assistant", [{"role": "assistant", "content": "hi"}], None),  # the template raises
    ] + GOOD[1:2]
    code, out, err = _job(run_cli, _write(tmp_path / "m.parquet", rows, "messages", MESSAGES), tmp_path / "m",
                          chat_base, "--messages-column", "messages")
    assert code == 0, err
    by_id = {r["id"]: r for r in pq.read_table(tmp_path / "m").to_pylist()}
    codes = {rid: by_id[rid]["error_code"] for rid, _, _ in rows}
    assert codes == {"r0": None, "r1": None, "null": "E_PROMPT_NULL", "empty": "E_PROMPT_MESSAGES",
                     "no-content": "E_PROMPT_MESSAGES", "assistant": "E_PROMPT_TEMPLATE"}
    assert "only system and user turns" in by_id["assistant"]["error_message"]
    assert json.loads(out)["errors_by_code"] == {"E_PROMPT_NULL": 1, "E_PROMPT_MESSAGES": 2, "E_PROMPT_TEMPLATE": 1}


def test_a_base_without_a_template_fails_before_any_row(tmp_path, run_cli):
    inp = _write(tmp_path / "m.parquet", GOOD, "messages", MESSAGES)
    code, _, err = _job(run_cli, inp, tmp_path / "out", os.path.join(DEMO, "base"), "--messages-column", "messages")
    assert code == 1 and "E_CHAT_TEMPLATE_MISSING" in err and not (tmp_path / "out").exists()


def test_messages_column_usage_and_type_errors(tmp_path, chat_base, run_cli):
    inp = _write(tmp_path / "m.parquet", GOOD, "messages", MESSAGES)
    for other in (("--prompt-column", "prompt"), ("--prompt-ids-column", "prompt_ids")):
        code, _, err = _job(run_cli, inp, tmp_path / "o1", chat_base, "--messages-column", "messages", *other)
        assert code == 2 and "E_USAGE" in err
    text = _write(tmp_path / "t.parquet", [(r, "plain text", a) for r, _, a in GOOD], "messages", pa.string())
    code, _, err = _job(run_cli, text, tmp_path / "o2", chat_base, "--messages-column", "messages")
    assert code == 1 and "E_INPUT_COLUMN_TYPE" in err and not (tmp_path / "o2").exists()


def test_the_ray_predictor_and_reader_carry_messages(tmp_path, chat_base):
    ray_mod = pytest.importorskip("mlora.batch.scaleout.ray", exc_type=JobError)
    from mlora.batch.config import JobConfig

    inp = _write(tmp_path / "m.parquet", GOOD + [("null", None, None)], "messages", MESSAGES)
    opts = JobConfig(input=str(inp), output="", base=chat_base, prompt_column=None, messages_column="messages")
    spec = InputSpec(prompt_column=None, messages_column="messages")
    windows = list(ray_mod.read_window({"lo": [0], "hi": [5]}, opts, open_input(str(inp), spec).fingerprint(), 8))
    table = pa.concat_tables(windows)
    assert sorted(table.column(ray_mod.ID).to_pylist()) == ["null", "r0", "r1", "r2", "r3"]
    predictor = ray_mod.MloraPredictor(chat_base, os.path.join(DEMO, "adapters"), device="cpu", max_new_tokens=12,
                                       messages_column="messages")
    out = predictor(pq.read_table(inp)).to_pylist()
    ref = _reference(chat_base)
    assert [r["num_prompt_tokens"] for r in out[:4]] == [len(_apply(ref, m)) for _, m, _ in GOOD]
    assert out[4]["error_code"] == "E_PROMPT_NULL" and all(r["error_code"] is None for r in out[:4])


def test_a_ray_messages_job_equals_the_local_job(tmp_path, chat_base):
    pytest.importorskip("ray", reason="ray is not installed (pip install 'mlora[ray]'); CI installs it")
    from mlora.batch.config import JobConfig
    from mlora.batch.job.output import read_output
    from mlora.batch.runner import run_job

    rows = GOOD + [("null", None, None), ("assistant", [{"role": "assistant", "content": "hi"}], "upper")]
    inp = str(_write(tmp_path / "m.parquet", rows, "messages", MESSAGES))
    opts = dict(input=inp, base=chat_base, adapters_dir=os.path.join(DEMO, "adapters"), prompt_column=None,
                messages_column="messages", device="cpu", max_new_tokens=12)
    run_job(JobConfig(output=str(tmp_path / "local"), **opts))
    run_job(JobConfig(output=str(tmp_path / "ray"), engine="ray", num_workers=1, **opts))
    local = read_output(str(tmp_path / "local"))
    assert read_output(str(tmp_path / "ray")).equals(local)
    assert local.column("error_code").to_pylist()[-2:] == ["E_PROMPT_NULL", "E_PROMPT_TEMPLATE"]
