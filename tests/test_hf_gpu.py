"""The foundation's Hugging Face models on the GPU, through the kernels (bf16): the Triton backend,
and whichever backend `auto` takes there (the Hopper backend on an sm90 GPU with the hopper extra).

Same tiny models and padded batches as tests/test_hf_models.py; the GPU "dash" run in bf16 is
compared with the fp32 eager run of the same weights on the CPU, by relative Frobenius error.
"""
import pytest
import torch

import dash_plugin
from tests.gpu_oracle import rel
from tests.test_hf_models import CONFIGS, load, logits_and_grads, pad_batch, saved, tokens  # noqa: F401

pytestmark = pytest.mark.gpu
BF16_TOL = 3e-2


def _auto_backend_here(head_dim):
    from dash_plugin.kernels import hopper, hopper_backend
    from dash_plugin.kernels.hopper.tile_table import head_dim_refusal
    on_hopper = hopper_backend._is_sm90(torch.device("cuda")) and hopper.available()
    return "hopper" if on_hopper and head_dim_refusal(head_dim) is None else "triton"


@pytest.mark.parametrize("backend", ("triton", "auto"))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_model_on_gpu_through_kernels_matches_fp32_eager(saved, name, backend):  # noqa: F811
    ids, mask = pad_batch(tokens([12, 7, 10]), "left")
    weight = mask[..., None].float() * torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(2))
    want_logits, want_grads = logits_and_grads(load(saved[name], "eager"), weight, input_ids=ids, attention_mask=mask)
    model = load(saved[name], "dash").to("cuda", torch.bfloat16)
    logits, grads = logits_and_grads(model, weight.cuda().bfloat16(), input_ids=ids.cuda(), attention_mask=mask.cuda(),
                                     dash_backend=backend)
    ran = dash_plugin.last_resolved()
    from dash_plugin.integrations.transformers import _head_dim
    want = "triton" if backend == "triton" else _auto_backend_here(_head_dim(model.config)[0])
    assert ran.concrete_backend == want and ran.deterministic, ran.describe()
    assert grads.keys() == want_grads.keys()
    keep = mask.bool()
    assert rel(logits[keep], want_logits[keep]) < BF16_TOL
    assert rel(torch.cat([g.flatten() for g in grads.values()]),
               torch.cat([want_grads[n].flatten() for n in grads])) < BF16_TOL


@pytest.mark.parametrize("decoder_len", [4, 10, 13])   # fewer, as many and more decoder tokens than encoder ones
def test_bart_cross_attention_over_padded_encoder_on_gpu_matches_fp32_eager(decoder_len):
    """Encoder self-attention (bidirectional, padded keys, every query kept) and decoder
    cross-attention (decoder queries against the encoder's real tokens) through the kernels."""
    from tests.test_hf_review import bart_config, eager_and_dash
    from transformers import BartForConditionalGeneration
    models = eager_and_dash(BartForConditionalGeneration, bart_config())
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(3, 128, (3, 10), generator=g)
    enc_mask = torch.ones(3, 10, dtype=torch.long)
    enc_mask[1, 6:] = 0
    enc_mask[2, :3] = 0
    dec = torch.randint(3, 128, (3, decoder_len), generator=g)
    weight = torch.randn(3, decoder_len, 128, generator=g)
    want_logits, want_grads = logits_and_grads(models["eager"], weight, input_ids=enc, attention_mask=enc_mask,
                                               decoder_input_ids=dec)
    model = models["dash"].to("cuda", torch.bfloat16)
    logits, grads = logits_and_grads(model, weight.cuda().bfloat16(), input_ids=enc.cuda(),
                                     attention_mask=enc_mask.cuda(), decoder_input_ids=dec.cuda())
    ran = dash_plugin.last_resolved()
    assert ran.concrete_backend in ("triton", "hopper") and ran.deterministic, ran.describe()
    assert grads.keys() == want_grads.keys()
    assert rel(logits.float().cpu(), want_logits) < BF16_TOL
    assert rel(torch.cat([g.float().cpu().flatten() for g in grads.values()]),
               torch.cat([want_grads[n].flatten() for n in grads])) < BF16_TOL
