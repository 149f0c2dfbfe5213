"""Review findings on the Hugging Face binding, each against transformers' eager attention (tiny
models built from configs, CPU, fp32): cross-attention over a padded encoder batch, packed batches
given by ``cu_seq_lens_q/k`` alone, and the mask overlays the binding cannot apply (Llama 4 chunks,
bidirectional blocks), which must be refused instead of dropped."""
import copy

import pytest
import torch

import dash_plugin  # noqa: F401  (registers "dash")
import dash_plugin.integrations.transformers as dash_hf
import transformers
from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM

from tests.test_hf_models import VOCAB, assert_close, assert_grads_close, logits_and_grads


def eager_and_dash(cls, config):
    """The same weights under "eager" and "dash" (each model gets its own copy of the config)."""
    models = {}
    for impl in ["eager", "dash"]:
        torch.manual_seed(0)
        models[impl] = cls._from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        assert models[impl].config._attn_implementation == impl
    models["dash"].load_state_dict(models["eager"].state_dict())
    return models


# ----------------------------------------------------------------------------------------------
# Cross-attention: the 2-D mask is the encoder's, the queries are the decoder's
# ----------------------------------------------------------------------------------------------

def bart_config():
    return BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                      dropout=0.0, attention_dropout=0.0, pad_token_id=0)


@pytest.fixture(scope="module")
def bart():
    return eager_and_dash(BartForConditionalGeneration, bart_config())


@pytest.mark.parametrize("decoder_len", [4, 10, 13])   # fewer, as many and more decoder tokens than encoder ones
def test_cross_attention_over_padded_encoder_matches_eager(bart, decoder_len):
    """Every decoder query attends to its row's real encoder tokens. The binding used to take the
    decoder queries for the last encoder positions: rows whose encoder input ends in padding lost
    their queries (zero outputs), and a decoder longer than the encoder was an error."""
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(3, VOCAB, (3, 10), generator=g)
    enc_mask = torch.ones(3, 10, dtype=torch.long)
    enc_mask[1, 6:] = 0   # right padding: the case that lost queries
    enc_mask[2, :3] = 0
    dec = torch.randint(3, VOCAB, (3, decoder_len), generator=g)
    weight = torch.randn(3, decoder_len, VOCAB, generator=g)
    results = {impl: logits_and_grads(model, weight, input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec)
               for impl, model in bart.items()}
    assert_close(results["dash"][0], results["eager"][0], f"bart logits, {decoder_len} decoder tokens")
    assert_grads_close(results["dash"][1], results["eager"][1], f"bart, {decoder_len} decoder tokens")


def test_cross_attention_generate_over_padded_encoder_matches_eager(bart):
    """Decode steps: one decoder query against the cached encoder keys, with encoder padding."""
    g = torch.Generator().manual_seed(2)
    enc = torch.randint(3, VOCAB, (2, 9), generator=g)
    enc_mask = torch.ones(2, 9, dtype=torch.long)
    enc_mask[0, 5:] = 0
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        out = {impl: m.generate(input_ids=enc, attention_mask=enc_mask, **kw) for impl, m in bart.items()}
    assert torch.equal(out["dash"].sequences, out["eager"].sequences)
    for step, (got, want) in enumerate(zip(out["dash"].scores, out["eager"].scores)):
        finite = torch.isfinite(want)   # min_new_tokens sets the EOS score to -inf
        assert torch.equal(finite, torch.isfinite(got))
        assert_close(got[finite], want[finite], f"bart generate scores, step {step}")


# ----------------------------------------------------------------------------------------------
# Packed batches given by cu_seq_lens_q/k without max_length_q/k
# ----------------------------------------------------------------------------------------------

def _llama_config():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def test_cu_seq_lens_without_max_lengths_keep_sequences_apart():
    """The offsets say where each sequence starts; the maximum lengths are a convenience. Without
    them the binding used to ignore the offsets and run one causal sequence across all of them."""
    models = eager_and_dash(LlamaForCausalLM, _llama_config())
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (5, 7, 4)]
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    with torch.no_grad():
        want = torch.cat([models["eager"](input_ids=s[None]).logits[0] for s in seqs])
        got = models["dash"](input_ids=torch.cat(seqs)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits[0]
    assert_close(got, want, "packed by cu_seq_lens_q/k alone")


def test_one_sided_cu_seq_lens_is_an_error():
    q = torch.randn(1, 2, 6, 16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q was given without cu_seq_lens_k"):
        dash_hf.dash_attention_forward(_Layer(), q, q, q, None, cu_seq_lens_q=cu)


class _Layer(torch.nn.Module):
    is_causal = True
    config = None


# ----------------------------------------------------------------------------------------------
# Mask overlays the binding cannot apply: refused, never dropped in silence
# ----------------------------------------------------------------------------------------------

def _llama4_config(chunk):
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=chunk, num_local_experts=2,
        num_experts_per_tok=1, moe_layers=[], max_position_embeddings=64)


def test_llama4_chunked_attention_is_refused_past_the_first_chunk():
    """Llama 4's chunked layers attend only inside chunks of attention_chunk_size tokens. The binding
    cannot apply chunks and used to run plain causal attention (different logits, no error)."""
    models = eager_and_dash(transformers.Llama4ForCausalLM, _llama4_config(chunk=6))
    assert "chunked_attention" in models["dash"].config.layer_types
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():   # within one chunk, chunking changes nothing: runs, and matches eager
        want, got = (models[impl](input_ids=ids).logits for impl in ("eager", "dash"))
    assert_close(got, want, "llama4 within one chunk")
    longer = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), pytest.raises(ValueError, match=r"chunked attention: attention_chunk_size=6 with 10 key"):
        models["dash"](input_ids=longer)


def test_bidirectional_blocks_are_refused():
    """block_sequence_ids (image tokens attending to each other both ways, e.g. Gemma 3) widen the
    causal mask; the dash mask used to drop them (None: plain causal)."""
    from transformers.masking_utils import create_causal_mask
    config = _llama_config()
    config._attn_implementation = "dash"
    embeds = torch.zeros(1, 6, 64)
    blocks = torch.tensor([[-1, 0, 0, 0, -1, -1]])
    with pytest.raises(ValueError, match="bidirectional attention blocks"):
        create_causal_mask(config, embeds, None, None, block_sequence_ids=blocks)
    # All -1: no block, nothing to widen.
    assert create_causal_mask(config, embeds, None, None, block_sequence_ids=torch.full((1, 6), -1)) is None
    assert create_causal_mask(config, embeds, None, None) is None
