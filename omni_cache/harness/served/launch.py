"""``omni-cache serve``: vLLM's OpenAI-compatible server with the omni cache and its delivery.

Owns: ``serve_command`` (the ``python -m vllm.entrypoints.openai.api_server`` command line for a
model plus the user's own vLLM options: the omni worker class, prefix caching, and
``OmniKVConnector`` with ``delivery_dir`` -- a connector the user configured is wrapped, not
replaced -- and the API server's check of a request's delivery options, ``request_check``), the built-in models (``BUILTIN``: ``tiny-llama``, a 2-layer Llama of width 128, and
``wide-llama``, a 16-layer Llama of width 1024 whose forward dominates a step; dummy weights and a
259-token byte-level tokenizer with a plain-text chat template, built once into a cache directory
by ``builtin_model_dir``, so a try-out needs no download and serves ``/v1/chat/completions`` too),
``plain_server_command`` (the same server without the cache, for comparisons),
``vllm_spelling`` (the user's options named as vLLM's parser reads them) and
``default_delivery_dir`` (a directory of the server's user only). vLLM is not imported here; the
launcher execs the server, so signals reach it directly.

Upholds: the command never carries a configuration the cache refuses silently: a
``--worker-cls`` other than the omni worker, ``--no-enable-prefix-caching``, a
``--kv-transfer-config`` that is not JSON, an ``OmniKVConnector`` of another module or nested in the
user's own connector (the tree holds one, and the launcher adds it) and a delivery
flag that disagrees with the user's own ``OmniKVConnector`` setting of the same key are refused
before anything starts (``ValueError``, one line naming the option), and so are settings the
connector would refuse at engine start (``connector_settings.tier_settings``, the same message: an
unknown ``omni_cache`` key, a ``delivery_dir`` or ``tier_dir`` where no directory can be made (an
existing file, a path below a file or an unwritable directory), a non-positive
``delivery_timeout_s``) and a ``delivery_dir`` of ``null`` (no delivery, which the launcher is for).
Options are read as vLLM reads them (an underscore for a dash), and an abbreviation or a dotted
sub-key of an option the launcher reads is refused (vLLM would take it past these checks).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from omni_cache.integration.request_check import MIDDLEWARE as REQUEST_CHECK

__all__ = ["BUILTIN", "DELIVERY_FLAGS", "TINY_LLAMA", "WORKER_CLS", "builtin_model_dir", "default_delivery_dir",
           "delivery_dir_of", "option_value", "plain_server_command", "serve_command", "tiny_llama_dir",
           "vllm_spelling"]

WORKER_CLS = "omni_cache.integration.vllm_worker.OmniCPUWorker"
CONNECTOR = {"kv_connector": "OmniKVConnector", "kv_connector_module_path": "omni_cache.integration.kv_tier",
             "kv_role": "kv_both"}
LOAD_FAILURE_POLICY = "kv_load_failure_policy"  # vLLM's KVTransferConfig field: a top-level setting
TINY_LLAMA = "tiny-llama"
WIDE_LLAMA = "wide-llama"
_COMMON_OPTIONS: tuple[tuple[str, str | None], ...] = (
    ("--load-format", "dummy"), ("--dtype", "float32"), ("--block-size", "32"), ("--enforce-eager", None),
    ("--max-model-len", "2048"), ("--max-num-batched-tokens", "1024"), ("--seed", "0"),
)
# A built-in model: its config key in ``harness.vllm_engine.models.MODELS`` and its engine options
# (every one can be overridden by the user's own flags).
BUILTIN: dict[str, tuple[str, tuple[tuple[str, str | None], ...]]] = {
    TINY_LLAMA: ("llama", (*_COMMON_OPTIONS, ("--kv-cache-memory-bytes", str(32 << 20)),
                           ("--served-model-name", TINY_LLAMA))),
    WIDE_LLAMA: ("wide", (*_COMMON_OPTIONS, ("--kv-cache-memory-bytes", str(256 << 20)),
                          ("--served-model-name", WIDE_LLAMA))),
}


def _uid_dir(name: str) -> str:
    """``<tmp>/omni-cache-<uid>/<name>``, the parent made 0700 and checked to be ours."""
    parent = os.path.join(tempfile.gettempdir(), f"omni-cache-{os.getuid()}")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    st = os.lstat(parent)
    if st.st_uid != os.getuid() or not os.path.isdir(parent) or os.path.islink(parent):
        raise ValueError(f"{parent} is not a directory of this user: choose another with --delivery-dir")
    os.chmod(parent, 0o700)
    return os.path.join(parent, name)


def default_delivery_dir() -> str:
    return _uid_dir("hidden-states")


def tiny_llama_dir() -> str:
    return builtin_model_dir(TINY_LLAMA)


def builtin_model_dir(name: str) -> str:
    """A built-in model's directory (config, tokenizer), built on first use and reused."""
    from omni_cache.harness.vllm_engine.models import sim_model

    config = sim_model(BUILTIN[name][0]).config
    # the tokenizer's files are part of the tag: a directory built with older ones is never reused
    tag = hashlib.sha256(json.dumps([config, _TOKENIZER_CONFIG], sort_keys=True).encode()).hexdigest()[:12]
    path = _uid_dir(f"{name}-{tag}")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    tmp = tempfile.mkdtemp(prefix=f"{name}-", dir=os.path.dirname(path))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f)
    _write_tokenizer(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another launcher built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_tokenizer(path: str) -> None:
    """A byte-level tokenizer: ``<unk>``, ``<s>``, ``</s>`` (ids 0-2, the model's bos/eos) then the 256
    byte symbols (ids 3-258): any text encodes, one token per byte, and decodes back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(_TOKENIZER_CONFIG, f)


# ``CHAT_TEMPLATE``: one line per message, ``role: content``, then ``assistant:`` when a reply is
# wanted; plain text only (no special token), so a chat prompt is the bytes of its rendering.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                     "unk_token": "<unk>", "model_max_length": 2048, "chat_template": CHAT_TEMPLATE}


def option_value(args: Sequence[str], name: str) -> tuple[int, str | None] | None:
    """Where ``name`` is in ``args`` (``--x v`` or ``--x=v``) and its value; ``None`` if absent."""
    for i, arg in enumerate(args):
        if arg == name:
            return i, args[i + 1] if i + 1 < len(args) else None
        if arg.startswith(name + "="):
            return i, arg.split("=", 1)[1]
    return None


DELIVERY_FLAGS = {"delivery_dir": "--delivery-dir", "include_output_tokens": "--include-output-tokens",
                  "allow_custom_save_path": "--allow-custom-save-path", "delivery_max_bytes": "--delivery-max-bytes",
                  "delivery_max_age_s": "--delivery-max-age", "delivery_timeout_s": "--delivery-timeout"}
"""Each delivery setting the launcher has a flag for: the ``omni_cache`` key -> the flag."""


def omni_transfer_config(user: str | None, delivery: dict[str, Any],
                         defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """``--kv-transfer-config`` with the omni connector: ``user``'s own connector becomes its wrapped
    child; an ``OmniKVConnector`` config of the user's keeps its delivery settings and gains those
    it lacks: ``delivery`` (the launcher's flags), then ``defaults``. A flag that disagrees with the
    user's own setting of the same key is refused (``ValueError`` naming both), never overridden
    either way; so is an ``OmniKVConnector`` from another module. A user's ``OmniKVConnector``
    without ``kv_connector_module_path`` or ``kv_role`` gets the omni connector's (vLLM needs both).

    With a wrapped connector, vLLM's ``kv_load_failure_policy`` (a setting of the whole engine, so
    lifted from the user's connector to the top) is ``"recompute"`` unless the user chose: the
    hidden-state tier lives in this server's memory, so a hit of an external KV store it holds no
    rows for (after a restart, or from a store that keys blocks without ``cache_salt``) is a failed
    load, which vLLM's default (``"fail"``) answers with an error for the request."""
    fill = dict(defaults or {})
    if user is None:
        return {**CONNECTOR, "kv_connector_extra_config": {"connectors": [], "omni_cache": {**fill, **delivery}}}
    try:
        config = json.loads(user)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    if config.get("kv_connector") == CONNECTOR["kv_connector"]:
        module = config.get("kv_connector_module_path", CONNECTOR["kv_connector_module_path"])
        if module != CONNECTOR["kv_connector_module_path"]:
            raise ValueError(f"--kv-transfer-config: kv_connector_module_path {module!r}: OmniKVConnector is "
                             f"{CONNECTOR['kv_connector_module_path']!r}")
        extra = config.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        theirs = extra.get("omni_cache") if isinstance(extra, dict) else None
        theirs = {} if isinstance(extra, dict) and theirs is None else theirs
        if not isinstance(theirs, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config and its omni_cache must be JSON objects")
        if "delivery_dir" in theirs and theirs["delivery_dir"] is None:
            raise ValueError("--kv-transfer-config: omni_cache.delivery_dir null turns delivery off, and omni-cache "
                             "serve delivers every request's hidden states: give a directory or leave the key out")
        if _nests_omni(config):
            raise ValueError("--kv-transfer-config: an OmniKVConnector inside your OmniKVConnector's connectors; a "
                             "server holds one: leave the inner one out")
        extra = dict(extra)
        for key, value in delivery.items():
            if key in theirs and not _same_setting(key, theirs[key], value):
                raise ValueError(f"{DELIVERY_FLAGS.get(key, key)} {value!r} and the --kv-transfer-config's "
                                 f"omni_cache.{key} {theirs[key]!r} disagree: give one of them")
        extra["omni_cache"] = {**fill, **delivery, **theirs}
        children = list(extra.get("connectors") or [])
        chosen = [c[LOAD_FAILURE_POLICY] for c in children if isinstance(c, dict) and LOAD_FAILURE_POLICY in c]
        if chosen:  # written in a child, where vLLM never reads it
            extra["connectors"] = [_without_policy(c) if isinstance(c, dict) else c for c in children]
        wrapped = {**CONNECTOR, **config, "kv_connector_extra_config": extra}
        if children:
            wrapped.setdefault(LOAD_FAILURE_POLICY, chosen[0] if chosen else "recompute")
        return wrapped
    if _nests_omni(config):
        raise ValueError("--kv-transfer-config: an OmniKVConnector inside your connector's connectors; the launcher "
                         "wraps your connector in OmniKVConnector itself: leave it out, or give OmniKVConnector at the top")
    return {**CONNECTOR, LOAD_FAILURE_POLICY: config.get(LOAD_FAILURE_POLICY, "recompute"),
            "kv_connector_extra_config": {"connectors": [_without_policy(config)], "omni_cache": {**fill, **delivery}}}


def _nests_omni(config: Any) -> bool:
    """An ``OmniKVConnector`` among ``config``'s wrapped connectors, at any depth (vLLM's ``MultiConnector``
    nests them under ``kv_connector_extra_config.connectors``); the tree may hold only one."""
    extra = config.get("kv_connector_extra_config") if isinstance(config, dict) else None
    children = extra.get("connectors") if isinstance(extra, dict) else None
    return isinstance(children, list) and any(
        isinstance(c, dict) and (c.get("kv_connector") == CONNECTOR["kv_connector"] or _nests_omni(c))
        for c in children)


def _same_setting(key: str, theirs: Any, flag: Any) -> bool:
    """A flag's value and a user's config value of ``key`` say the same (paths compared resolved)."""
    if key == "delivery_dir" and isinstance(theirs, str) and isinstance(flag, str) and theirs and flag:
        return os.path.realpath(os.path.abspath(theirs)) == os.path.realpath(os.path.abspath(flag))
    return bool(theirs == flag) and isinstance(theirs, bool) == isinstance(flag, bool)


def _check_connector_settings(transfer: dict[str, Any]) -> None:
    """The connector's own check of its settings (``connector_settings.tier_settings``: unknown keys,
    the tier's, the delivery's), run now instead of at engine start (its message, without the
    stage prefix)."""
    from omni_cache.integration.connector_settings import tier_settings  # no torch
    from omni_cache.integration.kv_nesting import STAGE_REFUSAL
    from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

    try:
        settings = tier_settings(transfer["kv_connector_extra_config"])
    except OmniPrefixCacheUnmatchError as exc:
        raise ValueError(str(exc).removeprefix(STAGE_REFUSAL)) from None
    assert settings["delivery"] is not None, "the launcher's config without delivery: launcher bug"


def _without_policy(connector: dict[str, Any]) -> dict[str, Any]:
    """A wrapped connector's config without ``kv_load_failure_policy`` (vLLM reads it at the top only)."""
    return {k: v for k, v in connector.items() if k != LOAD_FAILURE_POLICY}


# The options the launcher reads or adds: vLLM's parser takes a unique prefix of an option, and an
# underscore for a dash, so those spellings are read here as vLLM reads them (or refused).
_OWN_OPTIONS = ("--worker-cls", "--enable-prefix-caching", "--no-enable-prefix-caching", "--kv-transfer-config",
                "--model", "--host", "--tensor-parallel-size", "--pipeline-parallel-size", "--hf-token",
                "--revision", "--hf-config-path")
# NOTE: not --config-format, which vLLM's own --config is a prefix of (the launcher only reads it).
# The ``omni-cache serve`` options themselves: a near miss of one (``--delivery-max-byte``) is refused
# rather than handed to vLLM, which would fail on it half a minute later (no vLLM option is that close
# to one of them, tests/served/test_serve_launch.py checks vLLM's parser).
_DELIVERY_OPTIONS = (*DELIVERY_FLAGS.values(), "--dry-run")


def near_delivery_option(option: str) -> str | None:
    """The ``omni-cache serve`` option ``option`` (not one itself) is a near miss of, or None."""
    close = difflib.get_close_matches(option, _DELIVERY_OPTIONS, n=1, cutoff=0.8)
    if not close and option.startswith("--delivery"):
        close = difflib.get_close_matches(option, _DELIVERY_OPTIONS, n=1, cutoff=0.0)
    return close[0] if close else None


def vllm_spelling(args: Sequence[str]) -> list[str]:
    """``args`` with every option named as vLLM's parser reads it (underscores before the first ``.`` as
    dashes, as ``FlexibleArgumentParser`` does); ``ValueError`` for an abbreviation of an option the
    launcher reads (``--worker-cl``: vLLM would take it for ``--worker-cls`` unseen) or a dotted
    sub-key of one (``--kv-transfer-config.kv_connector``: set it in the one JSON value)."""
    out = []
    for arg in args:
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        head, dot, tail = name.partition(".")
        spelled = "--" + head[2:].replace("_", "-")
        if dot and spelled in _OWN_OPTIONS:
            raise ValueError(f"{name}: give {spelled} whole, as one JSON value (the launcher merges it; a dotted "
                             "sub-key would reach vLLM unseen)")
        if spelled not in _OWN_OPTIONS and (meant := [o for o in _OWN_OPTIONS if o.startswith(spelled)]):
            raise ValueError(f"{name}: spell out {' or '.join(meant)} (vLLM would take the abbreviation for it, "
                             "past the launcher's checks)")
        if spelled not in _DELIVERY_OPTIONS and (near := near_delivery_option(spelled)) is not None:
            raise ValueError(f"{name}: not an option of omni-cache serve; did you mean {near}? (a misspelt "
                             "option of omni-cache serve would go to vLLM unseen)")
        out.append(spelled + dot + tail + eq + value)
    return out


def delivery_dir_of(argv: Sequence[str]) -> str:
    """The ``delivery_dir`` a ``serve_command`` argv delivers into."""
    transfer = json.loads(argv[list(argv).index("--kv-transfer-config") + 1])
    return str(transfer["kv_connector_extra_config"]["omni_cache"]["delivery_dir"])


def serve_command(model: str, vllm_args: Sequence[str], *, delivery: dict[str, Any],
                  defaults: dict[str, Any] | None = None,
                  python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the environment variables it needs (see the module docstring);
    ``delivery`` and ``defaults`` as ``omni_transfer_config``'s."""
    args = vllm_spelling(vllm_args)
    worker = option_value(args, "--worker-cls")
    if worker is not None and worker[1] not in (WORKER_CLS, "omni_cache.integration.vllm_worker.OmniGPUWorker"):
        raise ValueError(f"--worker-cls {worker[1]}: the cache runs in {WORKER_CLS} (or OmniGPUWorker)")
    if "--no-enable-prefix-caching" in args:
        raise ValueError("--no-enable-prefix-caching: the cache keeps the rows prefix caching skips; serve "
                         "with plain vLLM to run without it")
    if (given := option_value(args, "--model")) is not None:
        raise ValueError(f"--model {given[1]}: serve's MODEL argument names the model; a --model among vLLM's "
                         "options would override it")
    user_config = option_value(args, "--kv-transfer-config")
    if user_config is not None and user_config[1] is None:
        raise ValueError("--kv-transfer-config needs a JSON value")
    if user_config is not None:
        del args[user_config[0] : user_config[0] + (1 if "=" in args[user_config[0]] else 2)]
    transfer = omni_transfer_config(user_config[1] if user_config else None, delivery, defaults)
    _check_connector_settings(transfer)
    model, extra = _model_options(model, args)
    if worker is None:
        extra += ["--worker-cls", WORKER_CLS]
    if "--enable-prefix-caching" not in args:
        extra.append("--enable-prefix-caching")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *extra,
            "--kv-transfer-config", json.dumps(transfer), "--middleware", REQUEST_CHECK, *args]
    world_size = _world_size(args)  # the last refusal: a -tp/-pp that is not an integer
    # NOTE: imported only now: the integration package imports torch, and a user's mistake is one
    # line before torch
    from omni_cache.integration.ranks import prepare_parallel_env

    env = {"VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")}
    # several CPU workers: each gets its own CPUs (vLLM's automatic binding wants a NUMA node per worker)
    env.update(prepare_parallel_env(world_size, dict(os.environ)))
    return argv, env


def _model_options(model: str, args: Sequence[str]) -> tuple[str, list[str]]:
    """The model path and the options the launcher adds: a built-in model's, and the loopback host."""
    extra: list[str] = []
    if model in BUILTIN:
        for name, value in BUILTIN[model][1]:
            if option_value(args, name) is None:
                extra += [name] if value is None else [name, value]
        model = builtin_model_dir(model)
    if option_value(args, "--host") is None:
        extra += ["--host", "127.0.0.1"]  # the files encode prompts: listen on loopback unless told otherwise
    return model, extra


def plain_server_command(model: str, vllm_args: Sequence[str], *, prefix_caching: bool,
                         python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """vLLM's own server for ``model`` with the same built-in options and no cache (for comparisons):
    prefix caching on or off."""
    args = vllm_spelling(vllm_args)
    model, extra = _model_options(model, args)
    extra.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *extra, *args]
    from omni_cache.integration.ranks import prepare_parallel_env  # torch: only once nothing is refused

    env = {"VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")}
    env.update(prepare_parallel_env(_world_size(args), dict(os.environ)))
    return argv, env


def _world_size(args: Sequence[str]) -> int:
    size = 1
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        for name in names:
            found = option_value(args, name)
            if found is not None:
                try:
                    size *= max(1, int(found[1] or 1))
                except ValueError:
                    raise ValueError(f"{name} wants an integer, got {found[1]!r}") from None
                break
    return size
