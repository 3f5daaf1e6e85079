"""Where ``omni-cache serve``'s MODEL comes from, checked before vLLM starts.

Owns: ``model_problem``. vLLM takes MODEL as a local path or a Hugging Face model id; given one it
cannot load (a typo, a path that does not exist, an id the hub does not know, or any id on a machine
that cannot reach the hub) it retries the hub for about half a minute and ends in a traceback. The
launcher asks first, without torch or vLLM, and refuses such a MODEL in one line:

* a built-in model (``launch.BUILTIN``) or an existing file or directory: served;
* a path that does not exist (absolute, ``.``/``~``-relative, or of more than two parts): refused;
* a model id in the local Hugging Face cache: served (offline too);
* otherwise, with ``HF_HUB_OFFLINE``: refused; without it the hub is asked (``model_info``): an id
  it knows, a gated one included (vLLM asks for the token), is served; one it does not know (or a
  private one without a token) is refused, and so is a hub that cannot be reached.

Models from ModelScope (``VLLM_USE_MODELSCOPE``) are left to vLLM. Upholds nothing of the cache's;
it only keeps a mistake from costing a server start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["model_problem"]

_TRUE = ("1", "true", "yes", "on")
_HUB_TIMEOUT_S = 10.0


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def model_problem(model: str, builtin: Iterable[str]) -> str | None:
    """None when vLLM can load ``model``, else one line saying why not (see the module docstring)."""
    names = sorted(builtin)
    if model in names:
        return None
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        return None
    choices = f"a built-in model ({', '.join(names)}), a local directory or a Hugging Face model id"
    if os.path.isabs(expanded) or model.startswith((".", "~")) or model.count("/") > 1:
        return f"MODEL {model!r}: no such file or directory; give {choices}"
    if _env_true("VLLM_USE_MODELSCOPE"):
        return None
    try:
        from huggingface_hub import constants, model_info
        from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    except ImportError:  # vLLM brings it; without it, vLLM decides
        return None
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(model)
    except HFValidationError as exc:
        return f"MODEL {model!r} is neither a path nor a Hugging Face model id ({exc}); give {choices}"
    cached = os.path.join(constants.HF_HUB_CACHE, "models--" + model.replace("/", "--"))
    if os.path.isdir(cached):
        return None
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return (f"MODEL {model!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
                f"is set; give {choices}")
    try:
        model_info(model, timeout=_HUB_TIMEOUT_S)
    except GatedRepoError:  # it exists; vLLM asks for the token
        return None
    except RepositoryNotFoundError:
        return (f"MODEL {model!r}: the Hugging Face hub has no such model (or it is private: set HF_TOKEN); "
                f"give {choices}")
    except Exception as exc:  # no network, a proxy, the hub down: vLLM could not download it either
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return (f"MODEL {model!r} is not in the Hugging Face cache and the hub ({constants.ENDPOINT}) cannot be "
                f"reached to fetch it ({type(exc).__name__}: {reason}); give {choices}")
    return None
