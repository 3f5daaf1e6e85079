"""Where ``omni-cache serve``'s MODEL comes from, checked before vLLM starts.

Owns: ``model_problem``. vLLM takes MODEL as a local path, a cloud-storage URL or a Hugging Face
model id; given one it cannot load (a typo, a path that does not exist, an id the hub does not know,
or any id on a machine that cannot reach the hub) it retries the hub for about half a minute and
ends in a traceback. The launcher asks first, without torch or vLLM, and refuses such a MODEL in
one line:

* a built-in model (``launch.BUILTIN``), a checkpoint directory (one with a ``config.json`` or a
  Mistral ``params.json``; any existing path when the server names the config itself with
  ``--hf-config-path`` or a ``--config-format``) or a GGUF file (by its magic bytes), as given (vLLM
  expands no ``~``), or a URL (``s3://``, ``gs://``, ...: vLLM's to load): served; any other
  existing file or directory: refused;
* a path that does not exist (absolute, ``.``/``~``-relative, or of more than two parts): refused;
* a model id in the local Hugging Face cache: served (offline too);
* otherwise, with ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``): refused; without it the hub is
  asked (``model_info``, with the server's ``--hf-token`` and ``--revision`` when given): an id it
  knows, a gated one included (vLLM asks for the token), is served; one it does not know (or a
  private one without a token) is refused, and so is a hub that cannot be reached.

Models from ModelScope (``VLLM_USE_MODELSCOPE``) are left to vLLM. Upholds nothing of the cache's;
it only keeps a mistake from costing a server start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["model_problem"]

_TRUE = ("1", "true", "yes", "on")  # huggingface_hub's reading of its boolean variables
_HUB_TIMEOUT_S = 10.0
_MODEL_DIR_FILES = ("config.json", "params.json")


def _is_gguf(path: str) -> bool:
    """A GGUF file: its first four bytes are the format's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _env_true(name: str, true: tuple[str, ...] = _TRUE) -> bool:
    return os.environ.get(name, "").strip().lower() in true


def _one_line(text: str) -> str:
    return " ".join(text.split())


def model_problem(model: str, builtin: Iterable[str], *, token: str | None = None,
                  revision: str | None = None, own_config: bool = False) -> str | None:
    """None when vLLM can load ``model``, else one line saying why not (see the module docstring).
    ``token`` and ``revision``: the server's ``--hf-token`` and ``--revision``; ``own_config``: the
    server names the model's config itself (``--hf-config-path``, a ``--config-format`` other than
    ``auto``), so a local path needs none of its own."""
    names = sorted(builtin)
    shown = _one_line(repr(model))
    choices = f"give a built-in model ({', '.join(names)}), a local directory or a Hugging Face model id"
    if model in names or "://" in model or (own_config and os.path.exists(model)):
        return None
    if os.path.isdir(model):  # a checkpoint directory: Hugging Face's config.json, or Mistral's params.json
        if any(os.path.isfile(os.path.join(model, name)) for name in _MODEL_DIR_FILES):
            return None
        return (f"MODEL {shown} is a directory with no {' or '.join(_MODEL_DIR_FILES)}: no model vLLM can load "
                f"(pass --hf-config-path if its config is elsewhere); {choices}")
    if os.path.exists(model):
        if _is_gguf(model):  # a single-file GGUF checkpoint, whatever its name
            return None
        return f"MODEL {shown} is a file, not a model directory (or a GGUF checkpoint); {choices}"
    if os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1:
        return f"MODEL {shown}: no such file or directory; {choices}"
    if _env_true("VLLM_USE_MODELSCOPE", ("1", "true")):  # vLLM's own reading of it
        return None
    try:
        from huggingface_hub import constants, model_info
        from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # vLLM brings it; without it, vLLM decides
        return None
    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        return f"MODEL {shown} is neither a path nor a Hugging Face model id ({_one_line(str(exc))}); {choices}"
    if os.path.isdir(os.path.join(constants.HF_HUB_CACHE, "models--" + model.replace("/", "--"))):
        return None
    offline = [name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _env_true(name)]
    if offline:
        return (f"MODEL {shown} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {offline[0]} is "
                f"set; {choices}")
    try:
        model_info(model, revision=revision, token=token, timeout=_HUB_TIMEOUT_S)
    except GatedRepoError:  # it exists; vLLM asks for the token
        return None
    except RepositoryNotFoundError:
        return (f"MODEL {shown}: the Hugging Face hub has no such model (or it is private: set HF_TOKEN or pass "
                f"--hf-token); {choices}")
    except Exception as exc:  # no network, a proxy, the hub down: vLLM could not download it either
        reason = _one_line(str(exc)) or type(exc).__name__
        return (f"MODEL {shown} is not in the Hugging Face cache and the hub ({constants.ENDPOINT}) cannot be "
                f"reached to fetch it ({type(exc).__name__}: {reason}); {choices}")
    return None
