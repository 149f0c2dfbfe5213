"""The config switch, source by source (highest first: call, context/configure, model config, env, torch flag, default)."""
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

import dash_plugin
from dash_plugin.config import resolve_config


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("DASH_SCHEDULE", "DASH_BACKEND", "DASH_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC"):
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
    with pytest.warns(UserWarning, match="overrides deterministic=True"):
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


def test_env_values_are_stripped_like_the_yes_no_ones(monkeypatch):
    monkeypatch.setenv("DASH_SCHEDULE", " shift\n")
    monkeypatch.setenv("DASH_BACKEND", " reference ")
    monkeypatch.setenv("DASH_DETERMINISTIC", " ON ")
    c = resolve_config()
    assert (c.schedule, c.backend, c.deterministic) == ("shift", "reference", True)
    monkeypatch.setenv("DASH_SCHEDULE", "   ")   # blank: unset
    assert resolve_config().schedule_source == "default"


def test_a_backend_that_cannot_run_the_call_names_the_source_that_chose_it(monkeypatch):
    # CPU tensors: the Hopper backend needs an sm90 GPU. (Not Triton without its interpreter: unsetting
    # TRITON_INTERPRET here would leave Triton's driver choice wrong for the tests after this one.)
    q = k = v = torch.randn(1, 8, 2, 64)
    monkeypatch.setenv("DASH_BACKEND", "hopper")
    with pytest.raises(ValueError, match=r"backend='hopper' cannot run this call: .*\(backend='hopper' from env "
                                         r"DASH_BACKEND\)$"):
        dash_plugin.flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"backend='hopper' cannot run this call: needs an sm90 \(Hopper\) GPU$"):
        dash_plugin.flash_attention(q, k, v, backend="hopper")   # the caller's own argument: nothing to add


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


def test_context_is_per_asyncio_task():
    """Two tasks interleave inside their own dash_config blocks: each sees its own schedule
    (a thread-local stack let the last task to enter win for both)."""
    import asyncio

    async def task(schedule, entered, go):
        with dash_plugin.dash_config(schedule=schedule):
            entered.set()
            await go.wait()
            return resolve_config().schedule

    async def main():
        entered_a, entered_b, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(task("shift", entered_a, go))
        await entered_a.wait()
        b = asyncio.create_task(task("spt", entered_b, go))
        await entered_b.wait()
        go.set()
        return await a, await b, resolve_config().schedule

    assert asyncio.run(main()) == ("shift", "spt", "auto")


@pytest.mark.parametrize("value", ["false", "true", 1, 0, "yes", 1.0])
def test_deterministic_arguments_take_real_bools_only(value):
    for set_it in (lambda: resolve_config(deterministic=value),
                   lambda: dash_plugin.configure(deterministic=value),
                   lambda: dash_plugin.dash_config(deterministic=value).__enter__(),
                   lambda: resolve_config(model_config=model(deterministic=value))):
        with pytest.raises(ValueError, match=r"deterministic=.* is not a bool; allowed: True, False"):
            set_it()


ENV_WORDS = [("1", True), ("true", True), ("YES", True), (" on ", True),
             ("0", False), ("False", False), ("no", False), ("off", False)]


@pytest.mark.parametrize("word,on", ENV_WORDS)
def test_dash_deterministic_env_words(monkeypatch, word, on):
    monkeypatch.setenv("DASH_DETERMINISTIC", word)
    c = resolve_config()
    assert (c.deterministic, c.deterministic_source) == (on, "env DASH_DETERMINISTIC")


@pytest.mark.parametrize("word,on", ENV_WORDS)
def test_flash_attention_deterministic_env_words_only_turn_determinism_on(monkeypatch, word, on):
    """The same words as DASH_DETERMINISTIC; a true word requires determinism (so atomic is
    refused), a false one says nothing (flash-attn's own default), like torch's flag."""
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", word)
    if on:
        assert resolve_config().deterministic_source == "env FLASH_ATTENTION_DETERMINISTIC"
        with pytest.raises(ValueError, match="not deterministic.*env FLASH_ATTENTION_DETERMINISTIC"):
            resolve_config(schedule="atomic")
    else:
        assert resolve_config().deterministic_source == "default"
        assert resolve_config(schedule="atomic").deterministic is False


@pytest.mark.parametrize("name", ["DASH_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC"])
@pytest.mark.parametrize("word", ["maybe", "2", "ture"])
def test_bad_env_words_are_errors_naming_the_variable(monkeypatch, name, word):
    monkeypatch.setenv(name, word)
    with pytest.raises(ValueError, match=rf"{name}={word!r} .*allowed: 1, 0, true, false, yes, no, on, off"):
        resolve_config()


def test_empty_env_variables_say_nothing(monkeypatch):
    for name in ("DASH_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC", "DASH_SCHEDULE"):
        monkeypatch.setenv(name, "")
    c = resolve_config()
    assert (c.schedule_source, c.deterministic_source) == ("default", "default")


@pytest.mark.parametrize("lower", ["torch", "FLASH_ATTENTION_DETERMINISTIC", "DASH_DETERMINISTIC"])
def test_a_higher_source_turning_determinism_off_warns(monkeypatch, lower):
    if lower == "torch":
        torch.use_deterministic_algorithms(True)
        named = r"torch.use_deterministic_algorithms\(True\)"
    else:
        monkeypatch.setenv(lower, "1")
        named = f"env {lower}"
    higher = [("env DASH_DETERMINISTIC", lambda: monkeypatch.setenv("DASH_DETERMINISTIC", "0"))] if lower != "DASH_DETERMINISTIC" else []
    higher += [("configure", lambda: dash_plugin.configure(deterministic=False)),
               ("call argument", lambda: None)]
    for source, turn_off in higher:
        turn_off()
        with pytest.warns(UserWarning, match=rf"deterministic=False \(from {source}.*\) overrides "
                                            rf"deterministic=True \(from {named}\)"):
            c = resolve_config(deterministic=False if source == "call argument" else None)
        assert c.deterministic is False


def test_no_warning_when_nothing_lower_asked_for_determinism(recwarn):
    resolve_config(deterministic=False)
    resolve_config(schedule="atomic")
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_compiled_calls_follow_the_switch(monkeypatch):
    """torch.compile(fullgraph=True) traces the switch: the graph is guarded on the thread's
    dash_config stack (a ContextVar cannot be traced), and the warning is given when traced. What
    the op receives is checked too (the op runs eagerly inside the graph), not only the record."""
    from dash_plugin import dispatch
    received = []
    forward = dispatch.attention_forward

    def spy(*args, schedule=None, **kw):
        received.append(schedule)
        return forward(*args, schedule=schedule, **kw)

    monkeypatch.setattr(dispatch, "attention_forward", spy)
    x = torch.randn(1, 8, 2, 16)
    compiled = torch.compile(lambda x: dash_plugin.flash_attention(x, x, x, causal=True), fullgraph=True)
    seen, concrete = [], []
    for context in (dict(schedule="descending"), dict(), dict(schedule="spt")):
        with dash_plugin.dash_config(**context):
            compiled(x)
        seen.append(dash_plugin.last_resolved().schedule)
        concrete.append(dash_plugin.last_resolved().concrete_schedule)
    assert seen == ["descending", "auto", "spt"]
    assert received == concrete and concrete[0] == "descending" and concrete[2] == "spt", (received, concrete)
    assert concrete[1] not in ("descending", "spt", "auto"), concrete   # auto's own choice for this shape
    torch.use_deterministic_algorithms(True)
    monkeypatch.setenv("DASH_DETERMINISTIC", "0")
    with pytest.warns(UserWarning, match=r"deterministic=False \(from env DASH_DETERMINISTIC\) overrides"):
        compiled(x)
    assert dash_plugin.last_resolved().deterministic is False


def test_remembered_answers_follow_every_source(monkeypatch):
    # resolve_config keeps its answers by everything it reads: a source changed between two
    # calls with the same arguments must change the answer, never return the kept one.
    first = resolve_config()
    assert resolve_config() is first                      # kept: same sources, same answer
    monkeypatch.setenv("DASH_SCHEDULE", "shift")
    assert resolve_config().schedule == "shift"
    monkeypatch.setenv("DASH_BACKEND", "reference")
    assert resolve_config().backend == "reference"
    monkeypatch.delenv("DASH_BACKEND")
    torch.use_deterministic_algorithms(True)
    assert resolve_config(schedule="descending").deterministic_source == "torch.use_deterministic_algorithms(True)"
    torch.use_deterministic_algorithms(False)
    assert resolve_config(schedule="descending").deterministic_source == "default"
    with dash_plugin.dash_config(schedule="spt"):
        assert resolve_config().schedule == "spt"
        with dash_plugin.dash_config(schedule="ascending"):
            assert resolve_config().schedule == "ascending"
        assert resolve_config().schedule == "spt"
    dash_plugin.configure(schedule="descending")
    assert resolve_config().schedule == "descending"
    dash_plugin.reset_config()
    assert resolve_config().schedule == "shift"            # the env again
    monkeypatch.delenv("DASH_SCHEDULE")
    monkeypatch.setenv("DASH_DETERMINISTIC", "0")
    assert resolve_config().deterministic is False
    monkeypatch.delenv("DASH_DETERMINISTIC")
    assert resolve_config().deterministic is True
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")   # it only turns determinism on
    assert resolve_config().deterministic_source == "env FLASH_ATTENTION_DETERMINISTIC"
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC")
    assert resolve_config().deterministic_source == "default"
    entry = model(schedule="spt")   # the model config's entry, changed in place between two calls
    assert resolve_config(model_config=entry).schedule == "spt"
    entry.dash_attention["schedule"] = "ascending"
    assert resolve_config(model_config=entry).schedule == "ascending"


def test_remembered_answers_keep_types_and_malformed_values_apart():
    assert resolve_config(model_config=model(deterministic=True)).deterministic is True
    # 1 == True and hashes alike; the model config takes real bools only, kept answer or not
    with pytest.raises(ValueError, match="deterministic=1"):
        resolve_config(model_config=model(deterministic=1))
    with pytest.raises(ValueError, match="deterministic=1"):
        resolve_config(deterministic=1)
    with pytest.raises(ValueError, match=r"schedule=\['shift'\]"):   # does not hash: refused, not a TypeError
        resolve_config(schedule=["shift"])


def test_a_kept_answer_still_warns_on_every_call(monkeypatch):
    monkeypatch.setenv("DASH_DETERMINISTIC", "0")
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_config()
        resolve_config()
    assert [str(w.message).count("overrides deterministic=True") for w in caught] == [1, 1]
