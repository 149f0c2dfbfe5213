"""``attn_implementation="dash"`` on real transformers models (tiny, built from configs, CPU, fp32).

Every model is saved with ``save_pretrained`` (safetensors) and loaded back with ``"dash"`` and with a
reference implementation (``"eager"``; generation also against ``"sdpa"`` where the model supports it).
The dash runs must match the reference on logits and on every parameter gradient, for left- and
right-padded batches (only non-pad positions compared), packed batches (against per-sequence runs) and
greedy generation with a KV cache.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

import dash_plugin  # noqa: F401  (registers "dash")
import dash_plugin.integrations.transformers as dash_hf
import transformers
from transformers import (AttentionInterface, AttentionMaskInterface, DataCollatorWithFlattening, Gemma2Config,
                          GPT2Config, LlamaConfig, MistralConfig, Qwen2Config)

VOCAB = 128
PAD = 0
# max |dash - reference| <= REL_TOL * max |reference|: fp32 with a different summation order.
REL_TOL = 1e-4

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
               pad_token_id=PAD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# Sliding windows of 4 tokens, with sequences of up to 12, so the window matters.
CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),  # GQA: 4 query heads, 2 KV heads
    "qwen2": lambda: Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=4),
    # A small softcap (2.0) so that ignoring it would change the result far beyond tolerance.
    "gemma2": lambda: Gemma2Config(**_COMMON, query_pre_attn_scalar=24, sliding_window=4,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=None),
    # Only attention dropout is on, so the dropout tests see the attention's randomness alone.
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=128,
                               attn_pdrop=0.2, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=PAD,
                               bos_token_id=1, eos_token_id=2),
}
SDPA_MODELS = {"llama", "qwen2", "mistral", "gpt2"}  # Gemma2 declares _supports_sdpa = False


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> directory of a saved tiny model (built once per module)."""
    dirs = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make())
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, safe_serialization=True)
        dirs[name] = d
    return dirs


def load(path, impl):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32)
    assert model.config._attn_implementation == impl
    return model.eval()


def tokens(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


def pad_batch(seqs, side):
    """(ids, mask) with PAD on the given side."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl] = s
        mask[i, sl] = 1
    return ids, mask


def assert_close(actual, expected, what, floor=1e-6):
    scale = expected.abs().max().clamp_min(floor)
    diff = (actual - expected).abs().max()
    assert diff <= REL_TOL * scale, f"{what}: max abs diff {diff:.3e} > {REL_TOL} x {scale:.3e}"


def logits_and_grads(model, weight, **inputs):
    """Logits and parameter gradients of loss = sum(weight * logits over the positions where weight != 0)."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    (logits * weight).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_grads_close(actual, expected, what):
    assert actual.keys() == expected.keys(), f"{what}: gradients for different parameters"
    assert len(expected) > 0
    # Gradients that are zero in exact arithmetic (e.g. a key bias, which softmax ignores) hold only
    # rounding noise: each tensor is compared relative to at least 1e-3 of the largest gradient.
    floor = 1e-3 * max(g.abs().max() for g in expected.values()).item()
    for n in expected:
        assert_close(actual[n], expected[n], f"{what} grad {n}", floor=floor)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def test_registered_after_import():
    assert AttentionInterface._global_mapping.get("dash") is dash_hf.dash_attention_forward
    assert AttentionMaskInterface._global_mapping.get("dash") is dash_hf.dash_attention_mask
    assert dash_hf.is_registered()
    dash_hf.register()  # idempotent
    dash_hf.register(lazy=False)
    assert AttentionInterface._global_mapping.get("dash") is dash_hf.dash_attention_forward


def test_register_is_lazy_and_hook_fires_on_transformers_import():
    """In a fresh interpreter: registering imports no modeling code, and loading a model afterwards works."""
    code = textwrap.dedent("""
        import sys
        import dash_plugin.integrations.transformers as t
        t.register()
        assert "transformers.modeling_utils" not in sys.modules, "register() imported transformers' modeling code"
        from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM
        assert AttentionInterface._global_mapping["dash"] is t.dash_attention_forward
        assert AttentionMaskInterface._global_mapping["dash"] is t.dash_attention_mask
        cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, head_dim=32)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="dash")
        assert model.config._attn_implementation == "dash"
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_mask_function_contract():
    m = dash_hf.dash_attention_mask
    ones = torch.ones(2, 6, dtype=torch.bool)
    assert m(2, 6, 6, attention_mask=None) is None
    assert m(2, 6, 6, attention_mask=ones) is None
    padded = ones.clone()
    padded[0, :2] = False
    out = m(2, 6, 6, attention_mask=padded)
    assert out.dtype == torch.bool and torch.equal(out, padded)
    # Sliding-window caches keep the last kv_length keys: the mask keeps its last columns.
    assert m(2, 1, 4, attention_mask=padded) is None  # the last 4 columns are all kept tokens
    padded[1, -1] = False
    assert torch.equal(m(2, 1, 4, attention_mask=padded), padded[:, -4:])


# ----------------------------------------------------------------------------------------------
# Padded, packed, generation: dash against the reference implementations
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_eager(saved, name, side):
    ids, mask = pad_batch(tokens([12, 7, 9]), side)
    weight = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(2)) * mask[..., None]
    ref_logits, ref_grads = logits_and_grads(load(saved[name], "eager"), weight, input_ids=ids, attention_mask=mask)
    logits, grads = logits_and_grads(load(saved[name], "dash"), weight, input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    assert_close(logits[keep], ref_logits[keep], f"{name} {side}-padded logits")
    assert_grads_close(grads, ref_grads, f"{name} {side}-padded")


def _per_sequence(model, seqs, weights):
    """Logits of each sequence run alone (no padding), and the gradients of the summed loss."""
    model.zero_grad(set_to_none=True)
    outs = []
    for s, w in zip(seqs, weights):
        logits = model(input_ids=s[None]).logits[0]
        (logits * w).sum().backward()
        outs.append(logits.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(outs), grads


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("how", ["position_ids", "flattening_collator"])
def test_packed_batch_matches_per_sequence_runs(saved, name, how):
    seqs = tokens([5, 11, 8], seed=3)
    weights = [torch.randn(len(s), VOCAB, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    if how == "position_ids":
        inputs = dict(input_ids=torch.cat(seqs)[None],
                      position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None])
    else:
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs])
        batch.pop("labels")
        assert batch["cu_seq_lens_q"].tolist() == [0, 5, 16, 24]
        inputs = dict(batch)

    dash = load(saved[name], "dash")
    calls = []
    spy_on_flash_attention(calls)
    try:
        logits, grads = logits_and_grads(dash, torch.cat(weights)[None], **inputs)
    finally:
        stop_spying()
    # The packed run went through varlen with the three sequences (not one causal sequence of 24).
    assert calls and all(c["cu_seqlens_q"].tolist() == [0, 5, 16, 24] for c in calls)

    ref_logits, ref_grads = _per_sequence(load(saved[name], "eager"), seqs, weights)
    assert_close(logits[0], ref_logits, f"{name} packed logits")
    assert_grads_close(grads, ref_grads, f"{name} packed")
    dash_logits, _ = _per_sequence(dash, seqs, weights)
    assert_close(logits[0], dash_logits, f"{name} packed vs dash per sequence")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_matches_reference(saved, name):
    """Greedy decoding with a KV cache (prefill, then one query against a longer cache): same tokens."""
    ref_impl = "sdpa" if name in SDPA_MODELS else "eager"
    ids, mask = pad_batch(tokens([9, 4, 6], seed=4), "left")
    kw = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=PAD)
    ref = load(saved[name], ref_impl).generate(ids, attention_mask=mask, **kw)
    out = load(saved[name], "dash").generate(ids, attention_mask=mask, **kw)
    assert out.shape == (3, 9 + 8)
    assert torch.equal(out, ref), f"{name}: dash {out[:, 9:].tolist()} vs {ref_impl} {ref[:, 9:].tolist()}"
    # No padding: the mask is dropped and decode steps take the dense path (bottom-right causal).
    ids = torch.stack(tokens([7, 7], seed=5))
    ref = load(saved[name], ref_impl).generate(ids, **kw)
    out = load(saved[name], "dash").generate(ids, **kw)
    assert torch.equal(out, ref)


def test_chunked_prefill_with_cache_matches_eager(saved):
    """A second chunk of 5 queries against a cache of 12 keys (S_q < S_kv, S_q > 1), with left padding."""
    ids, mask = pad_batch(tokens([12, 9], seed=6), "left")
    outs = {}
    for impl in ["eager", "dash"]:
        model = load(saved["mistral"], impl)
        first = model(input_ids=ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
        outs[impl] = model(input_ids=ids[:, 7:], attention_mask=mask, past_key_values=first.past_key_values,
                           use_cache=True).logits
    keep = mask[:, 7:].bool()
    assert_close(outs["dash"][keep], outs["eager"][keep], "chunked prefill logits")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_static_cache_matches_eager(monkeypatch, saved, name):
    """A static cache has unused key slots and, without padding, no mask: they must not be attended
    (llama: the binding cuts them). Mistral's sliding-window cache holds no unused slot: nothing may
    be cut there. Both are counted, so neither case passes by another path."""
    trim = dash_hf._trim_unused_cache
    cuts = []

    def counted(k, v, position_ids, q_len):
        out = trim(k, v, position_ids, q_len)
        cuts.append(out[0].shape[1] < k.shape[1])
        return out

    monkeypatch.setattr(dash_hf, "_trim_unused_cache", counted)
    ids = torch.stack(tokens([9, 9], seed=13))
    outs = {}
    for impl in ["eager", "dash"]:
        model = load(saved[name], impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        first = model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True).logits
        step = model(input_ids=ids[:, 6:7], past_key_values=cache, use_cache=True).logits
        rest = model(input_ids=ids[:, 7:], past_key_values=cache, use_cache=True).logits
        outs[impl] = torch.cat([first, step, rest], 1).detach()
    assert_close(outs["dash"], outs["eager"], f"{name} static-cache logits")
    assert cuts and any(cuts) == (name == "llama"), cuts


def test_bidirectional_encoder_padded_matches_eager():
    """BERT: non-causal attention (is_causal=False) with right padding, logits and gradients."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, mask = pad_batch(tokens([9, 6], seed=14), "right")
    results = {}
    for impl in ["eager", "dash"]:
        torch.manual_seed(0)
        model = transformers.BertModel._from_config(cfg, attn_implementation=impl).eval()
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(15)) * mask[..., None]
        (hidden * weight).sum().backward()
        results[impl] = hidden.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    keep = mask.bool()
    assert_close(results["dash"][0][keep], results["eager"][0][keep], "bert hidden states")
    assert_grads_close(results["dash"][1], results["eager"][1], "bert")


# ----------------------------------------------------------------------------------------------
# Dropout (GPT-2, attn_pdrop = 0.2)
# ----------------------------------------------------------------------------------------------

def _train_step(model, seed, ids, mask):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gpt2_dropout_is_seeded_and_train_only(saved):
    ids, mask = pad_batch(tokens([10, 6], seed=7), "right")
    model = load(saved["gpt2"], "dash").train()
    a_out, a_grads = _train_step(model, 123, ids, mask)
    b_out, b_grads = _train_step(model, 123, ids, mask)
    c_out, _ = _train_step(model, 124, ids, mask)
    keep = mask.bool()
    assert torch.equal(a_out, b_out), "same torch seed, different outputs"
    assert a_grads.keys() == b_grads.keys()
    assert all(torch.equal(a_grads[n], b_grads[n]) for n in a_grads), "same torch seed, different gradients"
    assert not torch.allclose(a_out[keep], c_out[keep]), "a different seed gave the same dropout"

    # Dropout is really applied in training (and not in eval mode, where dash matches eager).
    model.eval()
    with torch.no_grad():
        eval_out = model(input_ids=ids, attention_mask=mask).logits
        eager_out = load(saved["gpt2"], "eager")(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(a_out[keep], eval_out[keep])
    assert_close(eval_out[keep], eager_out[keep], "gpt2 eval logits")


# ----------------------------------------------------------------------------------------------
# What reaches dash_plugin.flash_attention
# ----------------------------------------------------------------------------------------------

_original = None


def spy_on_flash_attention(calls):
    """Record the keyword arguments of every flash_attention call the HF binding makes."""
    global _original
    _original = dash_hf._flash_attention

    def spy(q, k, v, **kw):
        calls.append(dict(kw, q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
        return _original(q, k, v, **kw)

    dash_hf._flash_attention = spy


def stop_spying():
    dash_hf._flash_attention = _original


@pytest.fixture
def calls():
    recorded = []
    spy_on_flash_attention(recorded)
    yield recorded
    stop_spying()


def test_per_call_kwargs_and_config_reach_flash_attention(saved, calls):
    model = load(saved["llama"], "dash")
    ids = torch.stack(tokens([6, 6], seed=8))
    with torch.no_grad():
        model(input_ids=ids, deterministic=True, dash_schedule="shift")
    assert len(calls) == 2  # one per layer
    for c in calls:
        assert c["deterministic"] is True and c["schedule"] == "shift"
        assert c["model_config"] is model.config
        assert c["causal"] is True and c["window"] == (-1, -1) and c["dropout_p"] == 0.0
        assert c["q_shape"] == (2, 6, 4, 32) and c["k_shape"] == (2, 6, 2, 32)  # dense, GQA not expanded
        assert c["softmax_scale"] == pytest.approx(32 ** -0.5)
    calls.clear()
    with torch.no_grad():
        model(input_ids=ids)
    assert all(c["deterministic"] is None and c["schedule"] is None for c in calls)  # left to the config switch


def test_window_softcap_scaling_reach_flash_attention(saved, calls):
    model = load(saved["gemma2"], "dash")
    with torch.no_grad():
        model(input_ids=torch.stack(tokens([10], seed=9)))
    by_layer = [(c["window"], c["softcap"], c["softmax_scale"]) for c in calls]
    # Gemma2 alternates sliding (W = 4 -> (3, 0)) and global layers; softcap 2.0; scale 24 ** -0.5.
    assert by_layer == [((3, 0), 2.0, pytest.approx(24 ** -0.5)), ((-1, -1), 2.0, pytest.approx(24 ** -0.5))]
    calls.clear()
    with torch.no_grad():  # no more keys than the window: no window passed (it would change nothing)
        model(input_ids=torch.stack(tokens([4], seed=9)))
    assert [c["window"] for c in calls] == [(-1, -1), (-1, -1)]


def test_set_attn_implementation_on_loaded_model(saved, calls):
    ids, mask = pad_batch(tokens([8, 5], seed=10), "left")
    model = load(saved["qwen2"], "eager")
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
    assert not calls
    model.set_attn_implementation("dash")
    assert model.config._attn_implementation == "dash"
    with torch.no_grad():
        switched = model(input_ids=ids, attention_mask=mask).logits
        loaded = load(saved["qwen2"], "dash")(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == 4  # 2 layers x 2 forwards, all through dash
    assert torch.equal(switched, loaded)
    keep = mask.bool()
    assert_close(switched[keep], eager[keep], "set_attn_implementation logits")


# ----------------------------------------------------------------------------------------------
# Errors and helpers
# ----------------------------------------------------------------------------------------------

class _Layer(torch.nn.Module):
    is_causal = True
    config = None


def test_four_d_mask_is_rejected_clearly():
    q = torch.randn(1, 2, 4, 32)
    mask4 = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"2-D padding mask.*shape \(1, 1, 4, 4\)"):
        dash_hf.dash_attention_forward(_Layer(), q, q, q, mask4)


def test_four_d_mask_through_model_is_rejected(saved):
    model = load(saved["llama"], "dash")
    ids = torch.stack(tokens([5], seed=11))
    mask4 = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="Custom 4-D masks are not supported"):
        model(input_ids=ids, attention_mask=mask4)


def test_sinks_are_not_implemented():
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(NotImplementedError, match="s_aux"):
        dash_hf.dash_attention_forward(_Layer(), q, q, q, None, s_aux=torch.zeros(2))


@pytest.mark.parametrize("name", ["position_bias", "sinks", "indices", "block_indices", "alibi"])
def test_score_changing_tensor_arguments_are_refused_by_name(name):
    """Layers pass what changes their scores as keywords (T5's position bias, sinks, sparse
    indices): they must not be dropped in silence."""
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(NotImplementedError, match=rf"`{name}`.*passed by _Layer.*attn_implementation='sdpa'"):
        dash_hf.dash_attention_forward(_Layer(), q, q, q, None, **{name: torch.zeros(1, 2, 4, 4)})


def test_bookkeeping_arguments_pass():
    """What leaves the scores alone passes: the Trainer's num_items_in_batch reaches every layer through
    the model's keyword arguments, and T5-style layers pass position_bias=None where they have none."""
    q = torch.randn(1, 2, 4, 32)
    out, _ = dash_hf.dash_attention_forward(_Layer(), q, q, q, None, position_ids=torch.arange(4)[None],
                                            cache_position=torch.arange(4), position_bias=None, use_cache=False,
                                            num_items_in_batch=torch.tensor(8))
    assert out.shape == (1, 4, 2, 32)


def test_t5_relative_position_bias_is_refused():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4)
    model = transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation="dash")
    ids = torch.stack(tokens([6], seed=13))
    with pytest.raises(NotImplementedError, match="position_bias"):
        model(input_ids=ids, decoder_input_ids=ids)


@pytest.mark.parametrize("config", [
    transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1, n_head=4),
    transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=1, num_heads=4,
                              attention_types=[[["global"], 1]]),
    transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4),
], ids=lambda c: type(c).__name__)
def test_models_with_attention_code_of_their_own_are_refused_when_built(config):
    """They never call the attention function but would get the dash mask, which has no causal
    part: Bloom ran unmasked before this refusal."""
    with pytest.raises(ValueError, match="runs attention code of its own"):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="dash")
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("config, reaches", [
    (LlamaConfig(**_COMMON), True),
    (transformers.BartConfig(), True),      # says no attention backend, yet its layers dispatch by name
    (transformers.CLIPConfig(), True),      # composite: its sub-models are checked when they are built
    (transformers.MptConfig(), False),      # a sub-config of options, not of a model
    (transformers.BloomConfig(), False),
], ids=lambda x: type(x).__name__ if not isinstance(x, bool) else str(x))
def test_which_models_reach_the_attention_function(config, reaches):
    model_class = transformers.AutoModel._model_mapping[type(config)]
    assert dash_hf._reaches_attention_interface(model_class, config) is reaches


def test_output_attentions_warns_that_no_weights_come(saved):
    """As transformers' sdpa and flash paths: a warning (pipelines pass the flag on), not empty
    `attentions` in silence; the outputs are those of the call without the flag."""
    import warnings
    model = load(saved["llama"], "dash")
    ids = torch.stack(tokens([5], seed=12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids, output_attentions=True)
    assert any("does not return attention weights" in str(w.message) for w in caught)
    assert not out.attentions
    assert torch.equal(out.logits, model(input_ids=ids).logits)


def test_packed_detection_from_position_ids():
    f = dash_hf._packed_from_position_ids
    assert f(None, 1, 6) is None
    assert f(torch.arange(6)[None], 1, 6) is None  # one sequence
    assert f(torch.arange(3, 9)[None], 1, 6) is None  # one sequence after a cache
    assert f(torch.arange(6)[None], 3, 6) is None  # broadcast rows, each one sequence
    assert f(torch.zeros(1, 1, dtype=torch.long), 1, 1) is None  # decode step
    cu, mx = f(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]), 1, 9)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 9] and mx == 4
    # Two rows, one of them packed: every row starts a sequence.
    cu, mx = f(torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]), 2, 4)
    assert cu.tolist() == [0, 4, 6, 8] and mx == 4


def test_padding_mask_is_unpadded_once_per_forward(saved, calls, monkeypatch):
    """Every layer gets the same padding mask: the unpadding (host syncs) runs once per forward, and
    all layers share its offsets tensors (so the kernels read the lengths once); an in-place change
    of the mask, or another query length, computes it again."""
    computed = []
    unpadding = dash_hf._unpadding
    monkeypatch.setattr(dash_hf, "_unpadding",
                        lambda mask, q_len, *rest: computed.append(q_len) or unpadding(mask, q_len, *rest))
    model = load(saved["llama"], "dash")
    ids, mask = pad_batch(tokens([9, 4, 6], seed=4), "right")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert model.config.num_hidden_layers == 2 and len(calls) == 2
    assert computed == [9]
    assert calls[0]["cu_seqlens_q"] is calls[1]["cu_seqlens_q"]
    assert calls[0]["cu_seqlens_q"].tolist() == [0, 9, 13, 19]

    q = torch.randn(3, 9, 4, 32)
    bool_mask = mask.bool()
    dash_hf._padded_forward(q, q, q, bool_mask, dict(causal=True))
    dash_hf._padded_forward(q, q, q, bool_mask, dict(causal=True))
    assert computed == [9, 9]
    bool_mask[1, 3] = False   # in place: the version counter moves
    out = dash_hf._padded_forward(q, q, q, bool_mask, dict(causal=True))
    assert computed == [9, 9, 9] and calls[-1]["cu_seqlens_q"].tolist() == [0, 9, 12, 18]
    assert (out[1, 3] == 0).all()
    dash_hf._padded_forward(q[:, -1:], q, q, bool_mask, dict(causal=True))   # a decode step
    assert computed == [9, 9, 9, 1]


def test_inference_mode_runs_every_path(saved):
    """Inference tensors keep no version counter: the per-tensor reuse must not ask them for one
    (a plain or packed forward under torch.inference_mode() used to raise)."""
    model = load(saved["llama"], "dash")
    ids, mask = pad_batch(tokens([9, 4, 6], seed=4), "left")
    seqs = tokens([5, 11, 8], seed=3)
    runs = {"plain": dict(input_ids=torch.stack(tokens([7, 7], seed=5))),
            "padded": dict(input_ids=ids, attention_mask=mask),
            "packed": dict(input_ids=torch.cat(seqs)[None],
                           position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None])}
    for name, inputs in runs.items():
        with torch.no_grad():
            want = model(**inputs).logits
        with torch.inference_mode():
            got = model(**inputs).logits
        assert torch.equal(got, want), name


def test_window_mapping():
    w = dash_hf._window
    assert w(None, True, 100) == (-1, -1)
    assert w(4, True, 4) == (-1, -1)  # no more keys than the window: nothing to cut
    assert w(4, True, 5) == (3, 0)  # the token itself and 3 earlier ones
    assert w(4, False, 5) == (3, 3)
    with pytest.raises(ValueError, match="sliding_window"):
        w(0, True, 5)


def test_config_switch_sees_call_kwargs_and_model_config(tmp_path):
    """Through the real API: the config switch names where the schedule and the determinism came from."""
    cfg = CONFIGS["llama"]()
    cfg.dash_attention = {"schedule": "descending", "deterministic": True}
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = load(tmp_path, "dash")
    assert model.config.dash_attention == {"schedule": "descending", "deterministic": True}  # kept in config.json
    ids = torch.stack(tokens([6], seed=12))
    with torch.no_grad():
        model(input_ids=ids)
        from_model = dash_plugin.last_resolved()
        model(input_ids=ids, dash_schedule="shift", deterministic=True)
        from_call = dash_plugin.last_resolved()
    assert (from_model.schedule, from_model.schedule_source) == ("descending", "model config dash_attention")
    assert from_model.deterministic and from_model.deterministic_source == "model config dash_attention"
    assert (from_call.schedule, from_call.schedule_source) == ("shift", "call argument")
    assert from_call.deterministic_source == "call argument"


def test_mixed_dtypes_under_autocast_are_unified(saved):
    """Under autocast, rotary embeddings hand over fp32 q/k beside a bf16 v: the function must use one
    dtype (autocast's), as SDPA does, and training under autocast must run."""
    from dash_plugin.integrations.transformers import _compute_dtype
    q32, v16 = torch.zeros(1, 1, 1, 32), torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)
    assert _compute_dtype(q32, q32, v16) == torch.bfloat16
    assert _compute_dtype(q32, q32, q32) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _compute_dtype(q32, q32, q32) == torch.bfloat16
    model = load(saved["llama"], "dash").train()
    ids, mask = pad_batch(tokens([12, 7]), "right")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------------------------
# Head dims: every one from 1 to 256 runs; others are refused when the model is loaded
# ----------------------------------------------------------------------------------------------

def _llama(head_dim, heads=4, kv_heads=2):
    return LlamaConfig(**dict(_COMMON, head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads))


@pytest.mark.parametrize("head_dim", [4, 8, 16])
def test_tiny_head_dims_match_eager(head_dim):
    """Hugging Face's own tiny test models use head dims below 32."""
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(_llama(head_dim), attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(_llama(head_dim), attn_implementation="dash")
    model.load_state_dict(eager.state_dict())
    ids, mask = pad_batch(tokens([12, 7, 9]), "right")
    weight = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(2)) * mask[..., None]
    ref_logits, ref_grads = logits_and_grads(eager, weight, input_ids=ids, attention_mask=mask)
    logits, grads = logits_and_grads(model, weight, input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    assert_close(logits[keep], ref_logits[keep], f"head dim {head_dim} logits")
    assert_grads_close(grads, ref_grads, f"head dim {head_dim}")


def test_unsupported_head_dim_is_refused_when_the_model_is_loaded(tmp_path):
    with pytest.raises(ValueError, match=r"attn_implementation='dash': LlamaForCausalLM has head dim 320 "
                                         r"\(config.head_dim\); allowed: 1..256"):
        transformers.AutoModelForCausalLM.from_config(_llama(320, heads=2, kv_heads=1), attn_implementation="dash")
    transformers.AutoModelForCausalLM.from_config(_llama(320, heads=2, kv_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has head dim 320"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="dash")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with pytest.raises(ValueError, match="has head dim 320"):
        model.set_attn_implementation("dash")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("config, found", [
    (GPT2Config(n_embd=64, n_head=2), (32, "hidden_size // num_attention_heads")),   # no head_dim attribute
    (LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=8), (8, "config.head_dim")),
    (transformers.PretrainedConfig(), None),   # says nothing: the first forward checks the tensors
])
def test_head_dim_of_a_config(config, found):
    from dash_plugin.integrations.transformers import _head_dim
    assert _head_dim(config) == found
