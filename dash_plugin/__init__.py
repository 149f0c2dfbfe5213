"""dash_plugin: bit-reproducible attention for PyTorch training.

``import dash_plugin`` registers ``attn_implementation="dash"`` with Hugging Face transformers
(when it is installed) and the ``torch.ops.dash`` custom ops.
"""
from .api import flash_attention
from .config import (SCHEDULES, DETERMINISTIC_SCHEDULES, ResolvedConfig, configure, dash_config, last_resolved,
                     reset_config, resolve_config)
from .kernels.philox import effective_dropout_p

__version__ = "0.1.0"
__all__ = ["flash_attention", "configure", "dash_config", "reset_config", "resolve_config", "last_resolved",
           "ResolvedConfig", "SCHEDULES", "DETERMINISTIC_SCHEDULES", "effective_dropout_p"]


def _register_integrations():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    from .integrations import transformers as hf
    register = getattr(hf, "register", None)
    if register is not None:
        register()


_register_integrations()
