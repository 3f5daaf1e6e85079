"""``omni-cache serve MODEL [vLLM options]``: vLLM's OpenAI server with the cache and its delivery.

Owns: the subcommand's arguments: ``MODEL`` (``tiny-llama``, the built-in dummy-weight model with
a small tokenizer, or any model vLLM serves), the delivery options (``--delivery-dir`` and the
rest, validated before anything is imported: a mistake is one line and exit 2) and every other
argument, which goes to vLLM's server unchanged. It then replaces this process with
``python -m vllm.entrypoints.openai.api_server`` (``harness.served.launch``), so Ctrl-C and
SIGTERM reach the server itself.

Upholds: a ``--delivery-dir`` another running server holds is refused before vLLM starts (one
line, exit 2); the worker's own claim stays the authority. So are the connector's settings it would
refuse at engine start, a flag that disagrees with the user's own setting of the same key, and a
configuration without delivery (``launch.serve_command``), and a MODEL vLLM could not load (a path
that does not exist, a model id neither cached nor on a reachable hub: ``model_source``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from typing import Any

from omni_cache.cli.args import EXIT_USAGE, float_range, int_range

__all__ = ["register"]


def _delivery_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-cache serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--delivery-dir", help="where each finished request's hidden-state file is written "
                        "(default: <tmp>/omni-cache-<uid>/hidden-states, the server user's only)")
    parser.add_argument("--include-output-tokens", action="store_true",
                        help="files also hold the rows of the output tokens (all but the last) by default; a "
                        "request's kv_transfer_params.include_output_tokens decides for that request")
    parser.add_argument("--allow-custom-save-path", action="store_true",
                        help="honour a request's kv_transfer_params.hidden_states_path, inside the delivery "
                        "directory only (as vLLM's allow_custom_save_path)")
    parser.add_argument("--delivery-max-bytes", type=int_range(1), help="retention: bytes of files kept "
                        "(oldest removed first; default 4 GiB)")
    parser.add_argument("--delivery-max-age", type=float_range(0, lo_open=True), help="retention: seconds a file "
                        "is kept (default 3600)")
    parser.add_argument("--delivery-timeout", type=float_range(0, lo_open=True), help="seconds a step waits for "
                        "its files before failing their requests (default 10)")
    parser.add_argument("--dry-run", action="store_true", help="print the server's command line and exit")
    return parser


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start vLLM's OpenAI server with the cache: each request's full-prompt hidden states delivered as "
        "a file in vLLM's hidden-states format, its path in the response's kv_transfer_params",
        description=(
            "Start vLLM's OpenAI-compatible server (python -m vllm.entrypoints.openai.api_server, vLLM's default "
            "multiprocess engine) with the omni cache: worker_cls OmniCPUWorker, prefix caching, and "
            "OmniKVConnector delivering each finished request's full-prompt hidden states (cached prefix rows "
            "and computed rows) as a safetensors file that vLLM's load_hidden_states reads; the path comes back "
            "in the response's kv_transfer_params.hidden_states_path. MODEL 'tiny-llama' is a built-in 2-layer "
            "Llama with dummy weights and a byte-level tokenizer (no download); 'wide-llama' the same at 16 layers "
            "of width 1024, a forward that dominates a step. Every argument after MODEL that "
            "is not a delivery option below goes to vLLM unchanged (e.g. --port 8011). A --kv-transfer-config "
            "of yours is wrapped by OmniKVConnector. docs/serving.md has the equivalent vllm serve line."),
        epilog="Delivery options (anywhere after MODEL): " + "; ".join(
            f"{a.option_strings[0]}: {a.help}" for a in _delivery_parser()._actions),
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", help="'tiny-llama', 'wide-llama' or a model vLLM serves")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    if args.model is None:
        parser.error("MODEL is required: 'tiny-llama', 'wide-llama' or a model vLLM serves")
    from omni_cache.harness.served.launch import vllm_spelling  # no torch, no vLLM

    try:
        args.vllm_args = vllm_spelling(args.vllm_args)  # as vLLM reads them: --delivery_dir is --delivery-dir
    except ValueError as exc:
        parser.error(str(exc))
    delivery_args, vllm_args = _delivery_parser().parse_known_args(args.vllm_args)
    if not args.model or args.model.startswith("-"):
        parser.error(f"MODEL comes first, got {args.model!r}")
    switches = [a.option_strings[0] for a in _delivery_parser()._actions if a.nargs == 0]
    for flag, after in zip(args.vllm_args, args.vllm_args[1:], strict=False):
        if flag in switches and not after.startswith("-"):  # vLLM would get the stray value unseen
            parser.error(f"{flag} takes no value, got {after!r}")
    if importlib.util.find_spec("vllm") is None:
        print("omni-cache serve: error: vLLM is not installed; see the README's set-up with the [vllm] extra",
              file=sys.stderr)
        return EXIT_USAGE
    from omni_cache.harness.served.launch import (
        BUILTIN,
        DELIVERY_FLAGS,
        default_delivery_dir,
        delivery_dir_of,
        option_value,
        serve_command,
    )
    from omni_cache.harness.served.model_source import model_problem

    token, revision = (found[1] if (found := option_value(vllm_args, name)) else None
                       for name in ("--hf-token", "--revision"))
    config_format = option_value(vllm_args, "--config-format")
    own_config = option_value(vllm_args, "--hf-config-path") is not None or (
        config_format is not None and config_format[1] not in (None, "auto"))
    if (problem := model_problem(args.model, BUILTIN, token=token, revision=revision,
                                 own_config=own_config)) is not None:
        parser.error(problem)  # before vLLM retries the hub for half a minute

    if delivery_args.delivery_dir is not None and not delivery_args.delivery_dir.strip():
        parser.error(f"--delivery-dir wants a directory path, got {delivery_args.delivery_dir!r}")
    delivery: dict[str, Any] = {}  # the flags given: a user's OmniKVConnector setting of the same key must agree
    for key, flag in DELIVERY_FLAGS.items():
        value = getattr(delivery_args, flag.lstrip("-").replace("-", "_"))
        if value not in (None, False):
            delivery[key] = os.path.abspath(value) if key == "delivery_dir" else value
    try:
        defaults = {} if "delivery_dir" in delivery else {"delivery_dir": default_delivery_dir()}
        argv, env = serve_command(args.model, vllm_args, delivery=delivery, defaults=defaults)
    except ValueError as exc:
        parser.error(str(exc))
    if delivery_args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
        return 0
    from omni_cache.integration.delivery_files import claim_holder

    directory = delivery_dir_of(argv)
    if (holder := claim_holder(directory)) is not None:  # the worker would refuse it, later
        parser.error(f"{directory} is the delivery directory of another running server "
                     f"(process {holder}); give each server its own --delivery-dir")
    print(f"omni-cache serve: {args.model}, hidden-state files in {directory}", file=sys.stderr,
          flush=True)
    os.execve(argv[0], argv, {**os.environ, **env})
