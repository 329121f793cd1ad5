"""The docs that are derived from code stay in sync with it."""

import os

from conftest import REPO

from mlora.lora_tools.findings import CODES, findings_doc


def test_findings_doc_is_generated_from_the_registry():
    with open(os.path.join(REPO, "docs", "findings.md")) as f:
        assert f.read() == findings_doc()


def test_readme_quickstart_has_the_two_commands_first():
    text = open(os.path.join(REPO, "README.md")).read()
    quick = text.split("## Quickstart", 1)[1]
    blocks = [b.split("\n", 1)[1].strip() for b in quick.split("```")[1::2]]
    assert blocks[0] == "bash scripts/demo.sh"
    assert blocks[1] == "bash scripts/test.sh"
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert "bash scripts/test.sh" in ci


def test_every_code_has_a_stable_prefix():
    for code, (severity, advice) in CODES.items():
        assert code[:2] == {"error": "E_", "unservable": "U_", "warning": "W_", "info": "I_"}[severity], code
        assert advice and not advice.endswith(".")
