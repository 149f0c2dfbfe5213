"""Hugging Face binding: ``attn_implementation="dash"``.

``import dash_plugin`` calls :func:`register`, which adds two entries to transformers' global registries:

- ``AttentionInterface["dash"] = dash_attention_forward``: the attention function every model layer calls;
- ``AttentionMaskInterface["dash"] = dash_attention_mask``: the mask builder. It follows the flash-attention
  contract: the layer receives ``None`` or a 2-D boolean padding mask (B, S_kv), never a (B, 1, S_q, S_kv)
  tensor. Without this entry transformers silently drops the padding mask for unknown names.

The attention function turns what the layer gives it into one call of :func:`dash_plugin.flash_attention`:

- padded batch (2-D mask): the padding tokens are removed ("unpadded") into the varlen layout with
  ``cu_seqlens``; the output is scattered back, with zero rows at padding in causal and windowed layers.
  Bidirectional layers without a window keep every query, each seeing its row's real keys (as eager does,
  padding rows included): in cross-attention the mask is the encoder's, and the decoder's queries all count;
- packed batch: ``cu_seq_lens_q/k`` (+ ``max_length_q/k``, read from the offsets where missing;
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or ``position_ids`` that restart inside a
  row: each run of consecutive positions is one sequence;
- otherwise the dense (B, S, H, D) layout. With a KV cache (decode, chunked prefill) ``S_q < S_kv`` and the
  causal mask is aligned bottom-right, as in flash-attn. A static cache's unused key slots are cut
  (from the mask when there is padding, else from ``position_ids``).

K/V are never expanded for GQA. Sliding windows, softcap, custom scaling and dropout (training only) are
forwarded. Mask overlays that none of these express (Llama 4's chunks past the first chunk, bidirectional
image-token blocks) are refused by the mask builder rather than dropped, and so are score-changing
arguments a layer passes (T5's position bias, attention sinks, sparse-attention indices) and models
whose layers never call the attention function (Bloom, Falcon, MPT, GPT-Neo).
Per-call ``deterministic=``, ``dash_schedule=`` and ``dash_backend=`` keywords given to ``model(...)``
reach this function and are forwarded; the model config goes along as ``model_config`` so its ``dash_attention`` entry
is one of the config switch's sources.

Importing transformers' modeling code costs seconds, so :func:`register` does not import it: when
transformers is not loaded yet, it installs an import hook that registers as soon as the two registry
modules are imported (which always happens before a model can be built).
"""
from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
import threading
import weakref
from typing import NamedTuple

import torch

__all__ = ["register", "is_registered", "dash_attention_forward", "dash_attention_mask", "NAME"]

NAME = "dash"

# Registry modules and the callback that registers into each. The class names are the same in
# transformers 5.17 to 5.23.
_ATTENTION_MODULE = "transformers.modeling_utils"
_MASK_MODULE = "transformers.masking_utils"

_lock = threading.Lock()


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _register_attention(modeling_utils) -> None:
    modeling_utils.AttentionInterface.register(NAME, dash_attention_forward)
    _check_model_at_load(modeling_utils.PreTrainedModel)


def _head_dim(config):
    """(head dim, where the config says it) of a model config, or None where it does not say.
    MLA models' query/key head dim is ``qk_head_dim`` (their ``head_dim`` is the rope part)."""
    for attr in ("qk_head_dim", "head_dim"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value, f"config.{attr}"
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads, "hidden_size // num_attention_heads"
    return None


def _check_model_at_load(pretrained_model) -> None:
    """A model whose layers never call the attention function, or with a head dim no path supports, is
    refused when ``attn_implementation="dash"`` is set (model construction, ``from_pretrained``,
    ``set_attn_implementation``), not at the first forward.
    transformers has no hook for a registered function's own checks, so the check wraps the method
    every one of those calls goes through."""
    original = pretrained_model._check_and_adjust_attn_implementation
    if getattr(original, "_dash_model_check", False):
        return

    def checked(self, attn_implementation, *args, **kwargs):
        chosen = original(self, attn_implementation, *args, **kwargs)
        if chosen == NAME and not _reaches_attention_interface(type(self), self.config):
            raise ValueError(
                f"attn_implementation='dash': {type(self).__name__} runs attention code of its own that does not "
                "call transformers' attention functions, so the dash kernels would never run and its layers "
                "would get the dash mask (padding only, no causal part). Use attn_implementation='sdpa' or "
                "'eager' for this model")
        found = _head_dim(self.config) if chosen == NAME else None
        if found is not None:
            from dash_plugin.checks import HEAD_DIM_MAX, HEAD_DIM_MIN
            if not HEAD_DIM_MIN <= found[0] <= HEAD_DIM_MAX:
                raise ValueError(f"attn_implementation='dash': {type(self).__name__} has head dim {found[0]} "
                                 f"({found[1]}); allowed: {HEAD_DIM_MIN}..{HEAD_DIM_MAX}. Use "
                                 "attn_implementation='sdpa' or 'eager' for this model")
        return chosen

    checked._dash_model_check = True
    checked.__wrapped__ = original
    pretrained_model._check_and_adjust_attn_implementation = checked


def _reaches_attention_interface(model_class, config) -> bool:
    """Whether a model's layers call the registered attention function. transformers accepts any
    registered name for every model, but some (Bloom, Falcon, MPT, GPT-Neo, GPT-NeoX-Japanese) run
    attention code of their own; they still build masks through the registered mask function,
    which for "dash" has no causal part, so their attention would run unmasked. Their modeling
    modules never name ``ALL_ATTENTION_FUNCTIONS``, through which every layer that dispatches by
    name goes. Composite models (sub-configs of other models: AutoConfig or a config with a
    model_type, unlike MPT's attention options) are checked per sub-model; a module whose source
    cannot be read is given the benefit of the doubt."""
    sub_configs = (getattr(config, "sub_configs", None) or {}).values()
    if any(getattr(sub, "model_type", None) != "" for sub in sub_configs):
        return True
    return _module_names_attention_registry(model_class.__module__)


@functools.lru_cache(maxsize=None)
def _module_names_attention_registry(module_name: str) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True


def _register_mask(masking_utils) -> None:
    masking_utils.AttentionMaskInterface.register(NAME, dash_attention_mask)


_CALLBACKS = {_ATTENTION_MODULE: _register_attention, _MASK_MODULE: _register_mask}


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after one of the registry modules has been executed.

    It only wraps the loader that the other finders return, so the module itself is imported exactly
    as without the hook. It removes itself once both modules are handled.
    """

    def __init__(self):
        self.pending = {name for name in _CALLBACKS if name not in sys.modules}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module):
            # Undo the patch first: a loader object may serve other modules too (e.g. a zip importer).
            try:
                del loader.exec_module
            except AttributeError:
                pass
            original_exec(module)
            if module.__name__ != fullname:
                return
            _CALLBACKS[fullname](module)
            self.pending.discard(fullname)
            if not self.pending:
                self.uninstall()

        loader.exec_module = exec_module
        return spec

    def uninstall(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


_hook: _RegisterOnImport | None = None


def register(lazy: bool = True) -> None:
    """Register ``"dash"`` with transformers' attention and attention-mask registries (idempotent).

    ``lazy=True`` (what ``import dash_plugin`` uses): registry modules already imported are registered at
    once; the others are registered by an import hook the moment transformers imports them, so importing
    dash_plugin does not pull in transformers' modeling code. ``lazy=False`` imports them and registers now.
    Both write the *global* mappings (``register`` classmethods), which every model instance consults.
    """
    global _hook
    with _lock:
        if not lazy:
            import importlib
            for name in _CALLBACKS:
                importlib.import_module(name)
        for name, callback in _CALLBACKS.items():
            module = sys.modules.get(name)
            # A module in sys.modules may still be executing (we are called from inside its import);
            # only register once its registry class exists.
            if module is not None and hasattr(module, _registry_class(name)):
                callback(module)
        if _hook is not None:
            _hook.uninstall()
            _hook = None
        if not is_registered():
            _hook = _RegisterOnImport()
            _hook.pending = {n for n in _CALLBACKS if not _registered_in(n)}
            sys.meta_path.insert(0, _hook)


def _registry_class(module_name: str) -> str:
    return "AttentionInterface" if module_name == _ATTENTION_MODULE else "AttentionMaskInterface"


def _registered_in(module_name: str) -> bool:
    module = sys.modules.get(module_name)
    registry = getattr(module, _registry_class(module_name), None) if module is not None else None
    expected = dash_attention_forward if module_name == _ATTENTION_MODULE else dash_attention_mask
    return registry is not None and registry._global_mapping.get(NAME) is expected


def is_registered() -> bool:
    """True when both global registries (already imported) hold the ``"dash"`` entries."""
    return all(_registered_in(name) for name in _CALLBACKS)


# ----------------------------------------------------------------------------------------------
# Mask function (flash-attention contract)
# ----------------------------------------------------------------------------------------------

def dash_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                        attention_mask=None, **kwargs):
    """Mask builder registered for ``"dash"``: ``None`` or the 2-D boolean padding mask (B, kv_length).

    Causality, sliding windows and packing are not encoded here: the attention function receives them as
    ``is_causal`` / ``sliding_window`` / ``position_ids`` / ``cu_seq_lens_*`` and hands them to the kernel.
    The mask keeps its last ``kv_length`` columns (sliding-window caches keep only the most recent keys).
    ``None`` is returned when nothing is padded and the mask covers the keys exactly; a mask shorter than
    the keys (static cache) is kept so that the attention function can cut the unused cache slots.
    """
    _reject_mask_overlays(mask_function, kv_length + kv_offset, kwargs.get("config"))
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def _mask_parts(mask_function):
    """Every function a transformers mask function is built from. ``and_masks``/``or_masks`` and the
    overlay factories keep their parts in closures (a function, or a tuple of them)."""
    parts, todo = [], [mask_function]
    while todo:
        fn = todo.pop()
        parts.append(fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:   # a cell not filled yet
                continue
            todo.extend(v for v in (value if isinstance(value, tuple) else (value,)) if hasattr(v, "__code__"))
    return parts


def _reject_mask_overlays(mask_function, kv_end, config):
    """The mask builder gets the model's whole mask pattern, but the attention function can only apply
    causal / window / padding / packing. Two transformers overlays go beyond that and would be dropped in
    silence: chunked attention (Llama 4) and bidirectional blocks (image tokens, e.g. Gemma 3). As on
    transformers' flash path, chunks are refused only where the keys reach past the first chunk (before
    that they change nothing)."""
    if mask_function is None:
        return
    for fn in _mask_parts(mask_function):
        name = getattr(fn, "__qualname__", "")
        if name.startswith("chunked_overlay."):
            chunk = getattr(config, "attention_chunk_size", None)
            if chunk is None or kv_end > chunk:
                raise ValueError(
                    f"dash attention does not support chunked attention: attention_chunk_size={chunk} with "
                    f"{int(kv_end)} key positions; allowed: at most attention_chunk_size key positions. Use "
                    f"attn_implementation='sdpa' or 'eager' for longer inputs")
        elif name.startswith("blockwise_overlay."):
            groups = _closure_tensor(fn)
            if groups is None or bool((groups >= 0).any()):
                raise ValueError(
                    "dash attention does not support bidirectional attention blocks (block_sequence_ids, e.g. "
                    "image tokens of Gemma 3) inside a causal mask; allowed: causal, sliding-window, padding and "
                    "packing masks. Use attn_implementation='sdpa' or 'eager' for this input")


def _closure_tensor(fn):
    """The tensor a mask overlay closes over (the block ids of ``blockwise_overlay``), or None."""
    for cell in getattr(fn, "__closure__", None) or ():
        if isinstance(cell.cell_contents, torch.Tensor):
            return cell.cell_contents
    return None


# ----------------------------------------------------------------------------------------------
# Attention function
# ----------------------------------------------------------------------------------------------

def _flash_attention(q, k, v, **kwargs):
    # Looked up at call time: the public API module imports this package's siblings, and tests may
    # replace this hook to observe the arguments.
    from dash_plugin.api import flash_attention
    return flash_attention(q, k, v, **kwargs)


def _compute_dtype(query, key, value):
    """One dtype for q, k, v. Under autocast, models hand over mixed dtypes (rotary embeddings
    return fp32 q/k beside a bf16 v): use autocast's dtype, as SDPA's autocast cast would."""
    device = query.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtypes = (query.dtype, key.dtype, value.dtype)
    half = [d for d in dtypes if d in (torch.float16, torch.bfloat16)]
    return half[0] if half and len(set(dtypes)) > 1 else query.dtype


def dash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers attention function for ``attn_implementation="dash"``.

    query (B, H_q, S_q, D), key/value (B, H_kv, S_kv, D) as the layers give them (K/V not GQA-expanded);
    ``attention_mask`` is ``None`` or a 2-D boolean padding mask from :func:`dash_attention_mask`.
    Returns ``(out (B, S_q, H_q, D_v), None)``: no attention weights.
    """
    _reject_unsupported(attention_mask, kwargs, module)
    batch, _, q_len, head_dim = query.shape
    dtype = _compute_dtype(query, key, value)
    q = query.transpose(1, 2).to(dtype)
    k = key.transpose(1, 2).to(dtype)
    v = value.transpose(1, 2).to(dtype)

    # The kernels need one head dim for q, k and v; a narrower value head (e.g. MLA) is zero-padded and
    # the padded output columns are cut again below.
    v_head_dim = v.shape[-1]
    if v_head_dim != head_dim:
        if v_head_dim > head_dim:
            raise ValueError(f"dash attention: value head dim {v_head_dim} is larger than the query/key head "
                             f"dim {head_dim}; only value head dims <= the query head dim are supported")
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    call = dict(
        causal=causal,
        softmax_scale=scaling,
        window=_window(sliding_window, causal, key_length=k.shape[1]),
        softcap=float(softcap) if softcap else 0.0,
        # Models pass their configured dropout in eval mode too (some do not check training): the layer's
        # mode decides, as for torch's own dropout.
        dropout_p=float(dropout) if getattr(module, "training", False) else 0.0,
        schedule=kwargs.get("dash_schedule"),
        deterministic=kwargs.get("deterministic"),
        backend=kwargs.get("dash_backend"),
        model_config=getattr(module, "config", None),
    )

    if attention_mask is not None:
        out = _padded_forward(q, k, v, attention_mask, call)
    elif kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        out = _varlen_forward(q, k, v, *_packed_from_kwargs(kwargs), call)
    else:
        packed = _packed_from_position_ids(kwargs.get("position_ids"), batch, q_len)
        if packed is not None:
            if k.shape[1] != q_len:
                raise ValueError(f"dash attention: packed sequences (position_ids restarting inside a row) need "
                                 f"as many keys as queries, got {q_len} queries and {k.shape[1]} keys (a KV "
                                 f"cache with packing is not supported)")
            cu_seqlens, max_seqlen = packed
            out = _varlen_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, call)
        else:
            k, v = _trim_unused_cache(k, v, kwargs.get("position_ids"), q_len)
            out = _flash_attention(q, k, v, **call)

    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out.contiguous(), None


def _packed_from_kwargs(kwargs):
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` as the model got them. The offsets alone already say
    where each sequence starts: missing maximum lengths are read from them (ignoring the offsets would
    let the packed sequences attend to each other)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        given, missing = ("cu_seq_lens_q", "cu_seq_lens_k") if cu_k is None else ("cu_seq_lens_k", "cu_seq_lens_q")
        raise ValueError(f"dash attention: {given} was given without {missing}; packed sequences need both "
                         f"(equal for self-attention), or neither")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if max_q is None:
        max_q = int(cu_q.diff().max())
    if max_k is None:
        max_k = int(cu_k.diff().max())
    return cu_q, cu_k, max_q, max_k


# Keywords some layers pass that change the scores in ways this function cannot express; dropping
# them would be silently wrong. Named, not "any unknown tensor": the Trainer's num_items_in_batch and
# the like reach every layer through the model's keyword arguments and leave the scores alone.
_SCORE_CHANGING_KWARGS = {
    "s_aux": "attention sinks (`s_aux`, e.g. gpt-oss)",
    "sinks": "attention sinks (`sinks`)",
    "position_bias": "an additive position bias (`position_bias`, e.g. T5's relative position bias)",
    "indices": "sparse attention over selected keys (`indices`, e.g. DeepSeek V3.2)",
    "block_indices": "block-sparse attention (`block_indices`)",
    "alibi": "ALiBi position biases (`alibi`)",
    "rel_pos": "relative position biases (`rel_pos`)",
}


def _reject_unsupported(attention_mask, kwargs, module=None):
    if kwargs.get("output_attentions"):
        # As transformers' sdpa and flash paths: a warning, not an error (pipelines pass the flag
        # on), so that empty `attentions` are not a silent surprise.
        from dash_plugin.config import warn_user
        warn_user("dash attention does not return attention weights: output_attentions=True gives no "
                  "`attentions`. Use attn_implementation='eager' to get them", stacklevel=3)
    passed = [what for name, what in _SCORE_CHANGING_KWARGS.items() if kwargs.get(name) is not None]
    if passed:
        layer = type(module).__name__ if module is not None else "the layer"
        raise NotImplementedError(f"dash attention does not support {passed[0]}, passed by {layer}; it would be "
                                  "dropped and the scores would be wrong. Use attn_implementation='sdpa' or "
                                  "'eager' for this model")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise NotImplementedError("dash attention does not support paged caches (continuous batching); "
                                  "use generate() with the default dynamic cache")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"dash attention accepts only a 2-D padding mask (batch, kv_len) of 1 = token / 0 = padding, got "
            f"attention_mask of shape {shape}. Custom 4-D masks are not supported: express padding with a 2-D "
            f"mask, packing with position_ids or cu_seq_lens_q/k, windows with the model's sliding_window, or "
            f"use attn_implementation='sdpa' / 'eager' for arbitrary masks")


def _window(sliding_window, causal, key_length):
    """HF sliding window W (a query sees itself and W-1 earlier keys) -> flash-attn (left, right).

    Applied only when there are more than W keys; with fewer it changes nothing (as transformers'
    flash path). A bidirectional layer gets the symmetric window (W-1, W-1).
    """
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    w = int(sliding_window)
    if w < 1:
        raise ValueError(f"dash attention: sliding_window must be >= 1, got {sliding_window}")
    return (w - 1, 0) if causal else (w - 1, w - 1)


def _gather_tokens(x, indices):
    """(B, S, H, D) -> (T, H, D): the tokens at flat positions ``indices`` (backward: scatter, no atomics)."""
    return x.reshape(-1, *x.shape[2:])[indices]


def _scatter_tokens(x, indices, batch, seqlen):
    """(T, H, D) -> (B, S, H, D) with zeros where no token goes (the inverse of :func:`_gather_tokens`)."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:])
    out[indices] = x
    return out.view(batch, seqlen, *x.shape[1:])


def _cu_seqlens(lengths):
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _padded_forward(q, k, v, mask, call):
    """2-D padding mask: drop the padding tokens, run varlen, put the outputs back in place.

    The mask covers the keys. A mask shorter than the keys means a static cache whose tail slots are
    unused: they are cut. In a causal layer the queries are the last ``S_q`` key positions (true with any
    KV cache), so their mask is the mask's last ``S_q`` columns; bottom-right causal alignment then holds
    per sequence for left padding (generation) and for right padding without a cache (training).
    A bidirectional layer without a window keeps every query (cross-attention: the mask is the
    encoder's); each one sees the real keys of its row, as in eager attention, padding rows included.
    """
    batch, q_len = q.shape[:2]
    if mask.shape[0] != batch:
        raise ValueError(f"dash attention: attention_mask has batch size {mask.shape[0]}, the queries {batch}")
    kv_len = mask.shape[1]
    # Causal and windowed layers place each query at a key position (the last S_q ones); elsewhere a
    # query needs no place: every one is kept and sees its row's real keys (cross-attention, whose mask
    # is the encoder's, even where the decoder happens to be as long as the encoder).
    queries_are_keys = call["causal"] or call["window"] != (-1, -1)
    if (queries_are_keys and kv_len < q_len) or kv_len > k.shape[1]:
        raise ValueError(f"dash attention: attention_mask covers {kv_len} positions; it must cover the keys "
                         f"({k.shape[1]}) and at least the queries ({q_len})")
    if k.shape[1] > kv_len:
        k, v = k[:, :kv_len], v[:, :kv_len]
    unpad = _once_per_tensor("padding", mask, (q_len, queries_are_keys),
                             lambda: _unpadding(mask, q_len, queries_are_keys))
    out = _flash_attention(
        _gather_tokens(q, unpad.idx_q), _gather_tokens(k, unpad.idx_k), _gather_tokens(v, unpad.idx_k),
        cu_seqlens_q=unpad.cu_seqlens_q, cu_seqlens_k=unpad.cu_seqlens_k,
        max_seqlen_q=unpad.max_seqlen_q, max_seqlen_k=unpad.max_seqlen_k, **call)
    return _scatter_tokens(out, unpad.idx_q, batch, q_len)


class _Unpadding(NamedTuple):
    idx_q: torch.Tensor          # flat positions of the query tokens
    idx_k: torch.Tensor          # flat positions of the key tokens
    cu_seqlens_q: torch.Tensor   # int32 offsets of the packed layout
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _unpadding(mask, q_len, queries_are_keys=True) -> _Unpadding:
    """Where the tokens of a (B, S_kv) padding mask go in the varlen layout; the queries are the
    last ``q_len`` key positions, or (``queries_are_keys=False``) every query is kept. Reads the
    lengths to the host (waits for the GPU)."""
    mask = mask.bool()
    if queries_are_keys:
        mask_q = mask[:, -q_len:]
    else:
        mask_q = torch.ones(mask.shape[0], q_len, dtype=torch.bool, device=mask.device)
    same = queries_are_keys and q_len == mask.shape[1]   # the queries are the keys' tokens
    idx_k = torch.nonzero(mask.reshape(-1)).flatten()
    idx_q = idx_k if same else torch.nonzero(mask_q.reshape(-1)).flatten()
    len_k = mask.sum(-1, dtype=torch.int32)
    len_q = len_k if same else mask_q.sum(-1, dtype=torch.int32)
    cu_k = _cu_seqlens(len_k)
    return _Unpadding(idx_q, idx_k, cu_k if same else _cu_seqlens(len_q), cu_k, int(len_q.max()), int(len_k.max()))


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, call):
    """Already packed (B rows flattened to one token axis): run varlen and restore (B, S_q, H, D)."""
    batch, q_len = q.shape[:2]
    out = _flash_attention(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), **call)
    return out.view(batch, q_len, *out.shape[1:])


def _trim_unused_cache(k, v, position_ids, q_len):
    """Cut key slots after the last query's position (a static cache's unused tail).

    Without padding transformers passes no mask at all, also with a static cache whose keys have
    ``max_cache_len`` slots of which only the first ``last position + 1`` are written. Bottom-right
    alignment would let the queries see the empty slots, so they are cut here. Dynamic caches have no
    such slots (nothing is cut) and sliding-window caches hold fewer keys than positions (nothing is cut).
    Only 2-D position ids that are token indices are read; the largest row decides, so rows whose
    positions differ can never lose a written key.
    """
    kv_len = k.shape[1]
    if kv_len <= q_len or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return k, v
    if position_ids.shape[-1] != q_len:
        return k, v
    end = int(position_ids[:, -1].max()) + 1
    if q_len <= end < kv_len:
        return k[:, :end], v[:, :end]
    return k, v


_LAST_ANSWERS = threading.local()


def _once_per_tensor(kind: str, tensor: torch.Tensor, key: tuple, compute):
    """``compute()``, or its answer for the same (kind, tensor object, version, key) as the last call.

    Every layer of a forward gets the same padding mask or ``position_ids`` tensor, and what is derived
    from it needs host syncs (nonzero, lengths): the layers after the first reuse it, and reusing the
    ``cu_seqlens`` tensors also lets the kernels read their lengths once. An in-place change bumps the
    version and recomputes. Inference tensors keep no version counter, so they are computed every time.
    """
    if torch.is_inference(tensor):
        return compute()
    key = (tensor._version, *key)
    answers = _LAST_ANSWERS.__dict__.setdefault("by_kind", {})
    last = answers.get(kind)
    if last is not None and last[0]() is tensor and last[1] == key:
        return last[2]
    found = compute()
    answers[kind] = (weakref.ref(tensor), key, found)
    return found


def _packed_from_position_ids(position_ids, batch, q_len):
    """`_find_packed_sequences`, once per ``position_ids`` tensor (see `_once_per_tensor`)."""
    if position_ids is None or not isinstance(position_ids, torch.Tensor):
        return None
    return _once_per_tensor("position_ids", position_ids, (batch, q_len),
                            lambda: _find_packed_sequences(position_ids, batch, q_len))


def _find_packed_sequences(position_ids, batch, q_len):
    """``(cu_seqlens, max_seqlen)`` when ``position_ids`` mark several sequences, else ``None``.

    A sequence is a run of consecutive positions (each one more than the one before), and every row
    starts a new one, so a row with a restart (``[0 1 2 0 1 ...]``) is split and rows of plain
    ``arange`` positions stay whole (then the dense path is used). Only 2-D position ids are read
    (multimodal rope ids with extra leading axes are left alone).
    """
    if position_ids is None or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or q_len < 2:
        return None
    if position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch):
        return None
    pos = position_ids.expand(batch, q_len)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    start_idx = torch.nonzero(starts.reshape(-1)).flatten().to(torch.int32)
    total = torch.tensor([batch * q_len], dtype=torch.int32, device=pos.device)
    cu_seqlens = torch.cat([start_idx, total])
    max_seqlen = int(cu_seqlens.diff().max())
    return cu_seqlens, max_seqlen
