"""The config switch, source by source (highest first: call, context/configure, model config, env, torch flag, default)."""
import threading
from types import SimpleNamespace

import pytest
import torch

import dash_plugin
from dash_plugin.config import resolve_config


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("DASH_SCHEDULE", "DASH_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    dash_plugin.reset_config()
    flag = torch.are_deterministic_algorithms_enabled()
    yield
    dash_plugin.reset_config()
    torch.use_deterministic_algorithms(flag)


def model(**entry):
    return SimpleNamespace(dash_attention=entry)


def test_default_is_deterministic_auto():
    c = resolve_config()
    assert (c.schedule, c.deterministic, c.schedule_source, c.deterministic_source) == ("auto", True, "default", "default")


def test_torch_flag_turns_determinism_on():
    torch.use_deterministic_algorithms(True)
    c = resolve_config(schedule="shift")
    assert c.deterministic and c.deterministic_source == "torch.use_deterministic_algorithms(True)"
    with pytest.raises(ValueError, match="atomic.*not deterministic"):
        resolve_config(schedule="atomic")


def test_env_beats_torch_flag_and_default(monkeypatch):
    monkeypatch.setenv("DASH_SCHEDULE", "descending")
    monkeypatch.setenv("DASH_DETERMINISTIC", "off")
    torch.use_deterministic_algorithms(True)
    c = resolve_config()
    assert (c.schedule, c.schedule_source) == ("descending", "env DASH_SCHEDULE")
    assert (c.deterministic, c.deterministic_source) == (False, "env DASH_DETERMINISTIC")


def test_flash_attention_deterministic_env(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    monkeypatch.setenv("DASH_SCHEDULE", "atomic")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_DETERMINISTIC"):
        resolve_config()
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "0")  # only "1" says anything, as in transformers
    c = resolve_config()
    assert (c.schedule, c.deterministic) == ("atomic", False)


def test_model_config_beats_env(monkeypatch):
    monkeypatch.setenv("DASH_SCHEDULE", "descending")
    monkeypatch.setenv("DASH_DETERMINISTIC", "1")
    c = resolve_config(model_config=model(schedule="spt", deterministic=True))
    assert (c.schedule, c.schedule_source) == ("spt", "model config dash_attention")
    assert c.deterministic_source == "model config dash_attention"
    c = resolve_config(model_config={"dash_attention": {"schedule": "split"}})  # a plain config dict works too
    assert c.schedule == "split" and c.deterministic_source == "env DASH_DETERMINISTIC"


def test_configure_beats_model_config_and_context_beats_configure():
    dash_plugin.configure(schedule="ascending")
    assert resolve_config(model_config=model(schedule="spt")).schedule_source == "configure()"
    with dash_plugin.dash_config(schedule="shift"):
        with dash_plugin.dash_config(schedule="descending"):
            assert resolve_config().schedule == "descending"
        c = resolve_config(model_config=model(schedule="spt"))
        assert (c.schedule, c.schedule_source) == ("shift", "dash_config() context")
    assert resolve_config().schedule == "ascending"


def test_call_argument_beats_everything(monkeypatch):
    monkeypatch.setenv("DASH_SCHEDULE", "descending")
    dash_plugin.configure(schedule="ascending", deterministic=True)
    with dash_plugin.dash_config(schedule="shift"):
        c = resolve_config(schedule="split", deterministic=True, model_config=model(schedule="spt"))
    assert (c.schedule, c.schedule_source, c.deterministic_source) == ("split", "call argument", "call argument")


def test_atomic_with_explicit_determinism_is_an_error_not_a_downgrade():
    with pytest.raises(ValueError, match=r"schedule='atomic' \(from call argument\).*deterministic=True \(from configure\(\)\)"):
        dash_plugin.configure(deterministic=True)
        resolve_config(schedule="atomic")


def test_atomic_alone_means_nondeterministic_and_false_alone_means_atomic():
    c = resolve_config(schedule="atomic")
    assert (c.deterministic, c.deterministic_source) == (False, "default for schedule='atomic' (from call argument)")
    c = resolve_config(deterministic=False)
    assert c.schedule == "atomic"


@pytest.mark.parametrize("bad", [dict(schedule="fast"), dict(schedule=3), dict(deterministic="maybe")])
def test_bad_values_name_the_argument_and_the_choices(bad):
    with pytest.raises(ValueError, match="allowed"):
        resolve_config(**bad)


def test_bad_env_value_names_its_source(monkeypatch):
    monkeypatch.setenv("DASH_SCHEDULE", "quick")
    with pytest.raises(ValueError, match="env DASH_SCHEDULE"):
        resolve_config()


def test_bad_model_entry():
    with pytest.raises(ValueError, match="dash_attention"):
        resolve_config(model_config=model(order="shift"))


def test_context_is_per_thread():
    seen = {}
    with dash_plugin.dash_config(schedule="shift"):
        t = threading.Thread(target=lambda: seen.update(other=resolve_config().schedule))
        t.start()
        t.join()
        seen["this"] = resolve_config().schedule
    assert seen == {"this": "shift", "other": "auto"}


def test_a_call_reports_what_it_resolved_to():
    q = torch.randn(1, 16, 2, 32)
    dash_plugin.flash_attention(q, q, q, causal=True, schedule="descending")
    last = dash_plugin.last_resolved()
    assert (last.schedule, last.concrete_schedule, last.deterministic) == ("descending", "descending", True)
    assert "descending (from call argument)" in last.describe()
    dash_plugin.flash_attention(q, q, q, causal=True)
    last = dash_plugin.last_resolved()
    assert last.schedule == "auto" and last.concrete_schedule in dash_plugin.DETERMINISTIC_SCHEDULES
