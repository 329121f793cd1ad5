"""The environment's integer knobs: one parser, the same refusal for every variable."""

import pytest

from mlora.batch.envknobs import env_int, env_row_range


def test_env_int_reads_defaults_and_refuses(monkeypatch):
    monkeypatch.delenv("MLORA_TEST_KNOB", raising=False)
    assert env_int("MLORA_TEST_KNOB", 7) == 7
    assert env_int("MLORA_TEST_KNOB", None) is None
    monkeypatch.setenv("MLORA_TEST_KNOB", "  ")  # empty: as unset
    assert env_int("MLORA_TEST_KNOB", 7) == 7
    monkeypatch.setenv("MLORA_TEST_KNOB", " 42 ")
    assert env_int("MLORA_TEST_KNOB", 7) == 42
    monkeypatch.setenv("MLORA_TEST_KNOB", "0")
    assert env_int("MLORA_TEST_KNOB", 7) == 0
    with pytest.raises(ValueError, match=r"MLORA_TEST_KNOB='0': expected a whole number of rows >= 1 \(unset it for 7\)"):
        env_int("MLORA_TEST_KNOB", 7, minimum=1, unit="rows")
    for bad in ("two", "-3", "1.5", "1e3"):  # never read as some other number
        monkeypatch.setenv("MLORA_TEST_KNOB", bad)
        with pytest.raises(ValueError, match="MLORA_TEST_KNOB=.*unset it for the automatic value"):
            env_int("MLORA_TEST_KNOB", None)


def test_env_choice_reads_defaults_and_refuses(monkeypatch):
    from mlora.batch.envknobs import env_choice

    monkeypatch.delenv("MLORA_TEST_CHOICE", raising=False)
    assert env_choice("MLORA_TEST_CHOICE", ("a", "b"), "a") == "a"
    monkeypatch.setenv("MLORA_TEST_CHOICE", "")  # empty: as unset
    assert env_choice("MLORA_TEST_CHOICE", ("a", "b"), "a") == "a"
    monkeypatch.setenv("MLORA_TEST_CHOICE", "b")
    assert env_choice("MLORA_TEST_CHOICE", ("a", "b"), "a") == "b"
    for bad in ("c", " b", "B"):  # never read as another choice
        monkeypatch.setenv("MLORA_TEST_CHOICE", bad)
        with pytest.raises(ValueError, match=r"MLORA_TEST_CHOICE=.*expected one of \('a', 'b'\) \(unset it for 'a'\)"):
            env_choice("MLORA_TEST_CHOICE", ("a", "b"), "a")


def test_env_row_range_reads_off_and_refuses(monkeypatch):
    monkeypatch.delenv("MLORA_TEST_RANGE", raising=False)
    assert env_row_range("MLORA_TEST_RANGE") is None
    assert env_row_range("MLORA_TEST_RANGE", (1, 64)) == (1, 64)
    for empty in ("", " "):  # as unset
        monkeypatch.setenv("MLORA_TEST_RANGE", empty)
        assert env_row_range("MLORA_TEST_RANGE", (1, 64)) == (1, 64)
    monkeypatch.setenv("MLORA_TEST_RANGE", "off")
    assert env_row_range("MLORA_TEST_RANGE", (1, 64)) is None
    monkeypatch.setenv("MLORA_TEST_RANGE", " 256:512 ")
    assert env_row_range("MLORA_TEST_RANGE") == (256, 512)
    monkeypatch.setenv("MLORA_TEST_RANGE", "64:64")
    assert env_row_range("MLORA_TEST_RANGE") == (64, 64)
    for bad in ("256", "512:256", "0:4", "a:b", "1:2:3", "-1:4", "on"):
        monkeypatch.setenv("MLORA_TEST_RANGE", bad)
        with pytest.raises(ValueError, match=r"MLORA_TEST_RANGE=.*expected LO:HI.*the default, off\)"):
            env_row_range("MLORA_TEST_RANGE")
