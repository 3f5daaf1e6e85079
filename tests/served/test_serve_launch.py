"""``omni-cache serve``'s command line: the server is started the way the cache needs, or not at all.

Protected first: ``serve_command`` never starts a server the cache would refuse or silently not
feed -- a foreign ``--worker-cls``, ``--no-enable-prefix-caching`` and a ``--kv-transfer-config``
that is not a JSON object are refused (one ``ValueError`` naming the option) -- and the server
listens on loopback unless told otherwise (the files encode prompts). Then the configuration it
builds: the omni worker and prefix caching are added once, a user's connector becomes the wrapped
child of ``OmniKVConnector`` (their option replaced, not duplicated), a user's own
``OmniKVConnector`` config keeps its settings and gains the delivery settings it lacks, the result
is a configuration the cache's own settings check and vLLM's ``KVTransferConfig`` accept, and
every tiny-llama option can be overridden. ``tiny_llama_dir`` builds the model directory once
(a byte-level tokenizer that round-trips any text) in a directory of this user only. The CLI's
argument errors (``serve`` and ``check-server``) exit 2 with one line, before torch is imported; a
``--delivery-dir`` another running server holds is refused the same way, before vLLM starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from omni_cache.cli import main
from omni_cache.harness.served import launch
from omni_cache.harness.served.launch import TINY_LLAMA, WORKER_CLS, omni_transfer_config, serve_command
from omni_cache.integration.connector_settings import tier_settings

ROOT = Path(__file__).resolve().parents[2]
DELIVERY = {"delivery_dir": "/srv/hidden-states"}


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The launcher's per-user directories go under this test's own temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _option(argv: list[str], name: str) -> list[str]:
    """Every value of ``name`` in ``argv`` (``--x v`` and ``--x=v``)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values + [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]


def _transfer(argv: list[str]) -> dict[str, Any]:
    (config,) = _option(argv, "--kv-transfer-config")
    return json.loads(config)


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("args", "phrase"), [
    (["--worker-cls", "vllm.v1.worker.cpu_worker.CPUWorker"], "--worker-cls vllm.v1.worker.cpu_worker.CPUWorker"),
    (["--worker-cls=my.Worker"], "--worker-cls my.Worker"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["--kv-transfer-config", "{not json"], "--kv-transfer-config is not JSON"),
    (["--kv-transfer-config=[1, 2]"], "--kv-transfer-config must be a JSON object"),
    (["--kv-transfer-config"], "--kv-transfer-config needs a JSON value"),  # before: dropped silently
    (["--model", "other/model"], "--model other/model: serve's MODEL argument names the model"),
    (["--model=other/model"], "--model other/model: serve's MODEL argument names the model"),
    # vLLM's own spellings of the same options: underscores (read as dashes), unique prefixes, dotted keys
    (["--worker_cls", "my.Worker"], "--worker-cls my.Worker"),
    (["--no_enable_prefix_caching"], "--no-enable-prefix-caching"),
    (["--worker-cl", "vllm.v1.worker.cpu_worker.CPUWorker"], "--worker-cl: spell out --worker-cls"),
    (["--worker_c=my.Worker"], "--worker_c: spell out --worker-cls"),
    (["--kv-transfer-conf", "{}"], "--kv-transfer-conf: spell out --kv-transfer-config"),
    (["--no-enable-prefix-cach"], "--no-enable-prefix-cach: spell out --no-enable-prefix-caching"),
    (["--kv-transfer-config.kv_connector=ExampleConnector"], "give --kv-transfer-config whole, as one JSON value"),
    (["--kv_transfer_config.kv_role", "kv_both"], "--kv_transfer_config.kv_role: give --kv-transfer-config whole"),
    (["--revis", "main"], "--revis: spell out --revision"),
])
def test_a_configuration_the_cache_cannot_run_is_refused(args: list[str], phrase: str) -> None:
    with pytest.raises(ValueError) as info:
        serve_command("some/model", ["--port", "8011", *args], delivery=DELIVERY)
    assert phrase in str(info.value) and len(str(info.value).splitlines()) == 1


def test_the_omni_gpu_worker_is_accepted_and_kept() -> None:
    gpu = "omni_cache.integration.vllm_worker.OmniGPUWorker"
    argv, _ = serve_command("some/model", ["--worker-cls", gpu], delivery=DELIVERY)
    assert _option(argv, "--worker-cls") == [gpu]


# ----------------------------------------------------------------------------- what it builds
def test_the_default_command_serves_on_loopback_with_the_cache_and_delivery() -> None:
    argv, env = serve_command("some/model", ["--port", "8011"], delivery=DELIVERY, python="/py")
    assert argv[:5] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "some/model"]
    assert _option(argv, "--host") == ["127.0.0.1"] and _option(argv, "--port") == ["8011"]
    assert _option(argv, "--worker-cls") == [WORKER_CLS] and argv.count("--enable-prefix-caching") == 1
    assert _transfer(argv) == {**launch.CONNECTOR, "kv_connector_extra_config": {"connectors": [],
                                                                                  "omni_cache": DELIVERY}}
    assert "--load-format" not in argv  # tiny-llama's options only for tiny-llama
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")}


@pytest.mark.parametrize("host", [["--host", "0.0.0.0"], ["--host=::"]])
def test_a_host_the_user_chose_is_kept(host: list[str]) -> None:
    argv, _ = serve_command("some/model", host, delivery=DELIVERY)
    assert _option(argv, "--host") == [host[-1].split("=")[-1]]


def test_flags_the_user_gave_are_not_doubled() -> None:
    argv, _ = serve_command("some/model", ["--enable-prefix-caching", "--worker-cls", WORKER_CLS], delivery=DELIVERY)
    assert argv.count("--enable-prefix-caching") == 1 and _option(argv, "--worker-cls") == [WORKER_CLS]


def test_options_are_read_as_vllm_spells_them() -> None:
    """An underscore spelling is the same option to vLLM: the launcher reads it as such (a user's
    ``--max_model_len`` replaces the built-in model's ``--max-model-len``, never beside it), and an
    option that only starts like one the launcher reads is left alone."""
    argv, _ = serve_command("tiny-llama", ["--max_model_len", "512", "--enable_prefix_caching", "--host=::",
                                           "--model-impl", "vllm", "--kv-cache-dtype.x=1"], delivery=DELIVERY)
    assert _option(argv, "--max-model-len") == ["512"] and "--max_model_len" not in argv
    assert argv.count("--enable-prefix-caching") == 1 and _option(argv, "--host") == ["::"]
    assert _option(argv, "--model-impl") == ["vllm"] and "--kv-cache-dtype.x=1" in argv


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_a_users_connector_becomes_the_wrapped_child(form: str) -> None:
    theirs = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": "/kv"}}
    text = json.dumps(theirs)
    option = ["--kv-transfer-config", text] if form == "separate" else [f"--kv-transfer-config={text}"]
    argv, _ = serve_command("some/model", ["--port", "1", *option, "--seed", "3"], delivery=DELIVERY)
    transfer = _transfer(argv)  # exactly one --kv-transfer-config: the user's was taken out
    assert transfer["kv_connector"] == "OmniKVConnector"
    assert transfer["kv_connector_extra_config"] == {"connectors": [theirs], "omni_cache": DELIVERY}
    assert transfer["kv_load_failure_policy"] == "recompute"  # a hit the tier has no rows for is recomputed
    assert _option(argv, "--seed") == ["3"] and _option(argv, "--port") == ["1"]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_load_failure_policy_the_user_chose_is_kept_at_the_top(policy: str) -> None:
    """vLLM reads ``kv_load_failure_policy`` from the top of the config only: a user's choice written
    in their own connector's config moves up with it, never left in the child where nothing reads it."""
    theirs = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy}
    transfer = omni_transfer_config(json.dumps(theirs), DELIVERY)
    assert transfer["kv_load_failure_policy"] == policy
    assert transfer["kv_connector_extra_config"]["connectors"] == [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
    own = {**launch.CONNECTOR, "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]}}
    assert omni_transfer_config(json.dumps(own), DELIVERY)["kv_load_failure_policy"] == policy
    in_child = {**launch.CONNECTOR, "kv_connector_extra_config": {"connectors": [theirs]}}
    lifted = omni_transfer_config(json.dumps(in_child), DELIVERY)
    assert lifted["kv_load_failure_policy"] == policy
    assert lifted["kv_connector_extra_config"]["connectors"] == [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]


def test_without_a_wrapped_connector_vllms_load_failure_policy_is_left_alone() -> None:
    """No external KV store, no external load: nothing for the policy to decide."""
    assert "kv_load_failure_policy" not in omni_transfer_config(None, DELIVERY)
    own = {**launch.CONNECTOR, "kv_connector_extra_config": {"connectors": []}}
    assert "kv_load_failure_policy" not in omni_transfer_config(json.dumps(own), DELIVERY)
    own["kv_connector_extra_config"]["connectors"] = [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
    assert omni_transfer_config(json.dumps(own), DELIVERY)["kv_load_failure_policy"] == "recompute"


def test_a_users_omni_connector_keeps_its_settings_and_gains_delivery() -> None:
    theirs = {**launch.CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_producer"}],
        "omni_cache": {"tier_bytes": 4096, "delivery_timeout_s": 3}}}
    transfer = omni_transfer_config(json.dumps(theirs), {"delivery_timeout_s": 3.0}, {"delivery_dir": "/d"})
    assert transfer["kv_role"] == "kv_producer"
    assert transfer["kv_connector_extra_config"] == {
        "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_producer"}],
        "omni_cache": {"delivery_dir": "/d", "delivery_timeout_s": 3, "tier_bytes": 4096}}
    # their own delivery_dir wins over the default (not over a flag: below)
    theirs["kv_connector_extra_config"]["omni_cache"]["delivery_dir"] = "/theirs"
    transfer = omni_transfer_config(json.dumps(theirs), {}, {"delivery_dir": "/d"})
    assert transfer["kv_connector_extra_config"]["omni_cache"]["delivery_dir"] == "/theirs"


@pytest.mark.parametrize(("flags", "phrase"), [
    ({"delivery_timeout_s": 10.0}, "--delivery-timeout 10.0 and the --kv-transfer-config's "
                                   "omni_cache.delivery_timeout_s 3 disagree"),
    ({"delivery_dir": "/elsewhere"}, "--delivery-dir '/elsewhere' and the --kv-transfer-config's "
                                     "omni_cache.delivery_dir '/theirs' disagree"),
    ({"include_output_tokens": True}, "--include-output-tokens True and the --kv-transfer-config's "
                                      "omni_cache.include_output_tokens False disagree"),
])
def test_a_flag_that_disagrees_with_the_users_own_setting_is_refused(flags: dict[str, Any], phrase: str) -> None:
    """Neither wins silently: the operator gave two values for one setting."""
    theirs = {**launch.CONNECTOR, "kv_connector_extra_config": {"omni_cache": {
        "delivery_dir": "/theirs", "delivery_timeout_s": 3, "include_output_tokens": False}}}
    with pytest.raises(ValueError) as info:
        omni_transfer_config(json.dumps(theirs), flags, {"delivery_dir": "/d"})
    assert phrase in str(info.value) and len(str(info.value).splitlines()) == 1
    agreeing = {"delivery_dir": "/theirs/", "delivery_timeout_s": 3.0, "include_output_tokens": False}
    settings = omni_transfer_config(json.dumps(theirs), agreeing)["kv_connector_extra_config"]["omni_cache"]
    assert settings == theirs["kv_connector_extra_config"]["omni_cache"]


def test_a_users_omni_connector_gets_the_module_and_role_vllm_needs() -> None:
    """vLLM refuses an ``OmniKVConnector`` without its module path (an unknown connector) or a
    ``kv_role``: the launcher fills in the omni connector's; another module is refused."""
    bare = omni_transfer_config('{"kv_connector": "OmniKVConnector"}', DELIVERY)
    assert bare["kv_connector_module_path"] == launch.CONNECTOR["kv_connector_module_path"]
    assert bare["kv_role"] == "kv_both"
    assert bare["kv_connector_extra_config"]["omni_cache"] == DELIVERY
    with pytest.raises(ValueError, match=re.escape("kv_connector_module_path 'my.module': OmniKVConnector is "
                                                   "'omni_cache.integration.kv_tier'")):
        omni_transfer_config('{"kv_connector": "OmniKVConnector", "kv_connector_module_path": "my.module"}', DELIVERY)
    nested = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}, {"kv_connector": "OmniKVConnector"}]}}
    with pytest.raises(ValueError, match="an OmniKVConnector inside your connector's connectors"):
        omni_transfer_config(json.dumps(nested), DELIVERY)
    inside_ours = {"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {"connectors": [nested]}}
    with pytest.raises(ValueError, match="an OmniKVConnector inside your OmniKVConnector's connectors"):
        omni_transfer_config(json.dumps(inside_ours), DELIVERY)
    # a wrapped connector's own settings are its own, whatever their keys: never read as connectors
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
               "kv_connector_extra_config": {"connectors": ["a"]}}
    argv, _ = serve_command("some/model", ["--kv-transfer-config", json.dumps(lmcache)], delivery=DELIVERY)
    assert _transfer(argv)["kv_connector_extra_config"]["connectors"] == [lmcache]
    for extra in ('{"omni_cache": 5}', '{"omni_cache": []}', '{"omni_cache": false}', "[]"):
        with pytest.raises(ValueError, match="kv_connector_extra_config and its omni_cache must be JSON objects"):
            omni_transfer_config(f'{{"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {extra}}}', DELIVERY)


@pytest.mark.parametrize(("setting", "phrase"), [
    ({"delivery_timeout_s": -1}, "omni_cache.delivery_timeout_s must be a positive number, got -1"),
    ({"delivery_dir": "FILE"}, "is an existing file, not a directory"),
    ({"tier_dir": "FILE/sub"}, "a-file/sub' cannot be created: "),
    ({"delivery_dir": "FILE/sub"}, "cannot be created: "),
    ({"include_output_tokens": "yes"}, "omni_cache.include_output_tokens must be true or false, got 'yes'"),
    ({"delivery_timout_s": 3}, "unknown kv_connector_extra_config['omni_cache'] keys ['delivery_timout_s']"),
    ({"tier_bytes": -1}, "['tier_bytes'] must be a non-negative int, got -1"),
])
def test_delivery_settings_the_connector_would_refuse_are_refused_before_the_server_starts(
        setting: dict[str, Any], phrase: str, tmp_path: Path) -> None:
    """The connector's own check (``connector_settings.tier_settings``), run by the launcher: the message
    the engine would end in, minutes later and inside a traceback, is one line before anything starts;
    and a configuration that turns delivery off, which is what the launcher is for."""
    (tmp_path / "a-file").write_text("")
    setting = {k: v.replace("FILE", str(tmp_path / "a-file")) if isinstance(v, str) else v for k, v in setting.items()}
    theirs = {"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}], "omni_cache": setting}}
    with pytest.raises(ValueError) as info:
        serve_command("some/model", ["--kv-transfer-config", json.dumps(theirs)], delivery={},
                      defaults={"delivery_dir": str(tmp_path / "files")})
    assert phrase in str(info.value) and len(str(info.value).splitlines()) == 1
    assert "OmniKVConnector: OmniKVConnector" not in str(info.value)


@pytest.mark.parametrize("user", [None, '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}',
                                  '{"kv_connector": "OmniKVConnector", "kv_connector_module_path": '
                                  '"omni_cache.integration.kv_tier", "kv_role": "kv_both"}'])
def test_the_built_configuration_is_one_the_cache_and_vllm_accept(user: str | None, tmp_path: Path) -> None:
    transfer = omni_transfer_config(user, {"delivery_dir": str(tmp_path), "delivery_max_bytes": 1 << 20})
    settings = tier_settings(transfer["kv_connector_extra_config"])
    assert settings["delivery"].delivery_dir == os.path.realpath(tmp_path)
    assert settings["delivery"].delivery_max_bytes == 1 << 20
    if importlib.util.find_spec("vllm") is not None:
        from vllm.config import KVTransferConfig

        assert KVTransferConfig(**transfer).kv_connector == "OmniKVConnector"


def test_every_tiny_llama_option_can_be_overridden() -> None:
    argv, _ = serve_command(TINY_LLAMA, ["--block-size", "16", "--max-model-len=4096", "--served-model-name", "t"],
                            delivery=DELIVERY)
    assert argv[argv.index("--model") + 1] == launch.tiny_llama_dir()
    assert _option(argv, "--block-size") == ["16"] and _option(argv, "--max-model-len") == ["4096"]
    assert _option(argv, "--served-model-name") == ["t"]
    for name, value in launch.BUILTIN[launch.TINY_LLAMA][1]:
        if name not in ("--block-size", "--max-model-len", "--served-model-name"):
            assert (_option(argv, name) == [value]) if value is not None else argv.count(name) == 1, name


@pytest.mark.parametrize(("args", "workers"), [(["-tp", "2"], 2), (["--tensor-parallel-size=2", "-pp", "2"], 4)])
def test_several_cpu_workers_get_their_own_cpus(args: list[str], workers: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    _, env = serve_command("some/model", args, delivery=DELIVERY)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == workers
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve_command("some/model", args, delivery=DELIVERY)[1]  # the user's


# ----------------------------------------------------------------------------------- tiny-llama
def test_the_tiny_llama_directory_is_built_once_in_a_directory_of_this_user(private_tmp: Path) -> None:
    path = launch.tiny_llama_dir()
    parent = private_tmp / f"omni-cache-{os.getuid()}"
    assert os.path.dirname(path) == str(parent) and stat.S_IMODE(parent.stat().st_mode) == 0o700
    assert sorted(os.listdir(path)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    built = os.stat(os.path.join(path, "tokenizer.json")).st_mtime_ns
    assert launch.tiny_llama_dir() == path and os.stat(os.path.join(path, "tokenizer.json")).st_mtime_ns == built
    assert [n for n in os.listdir(parent) if n.startswith("tiny-llama-") and n != os.path.basename(path)] == []
    assert launch.default_delivery_dir() == str(parent / "hidden-states")


def test_the_tiny_tokenizer_round_trips_any_text_one_token_per_byte() -> None:
    from tokenizers import Tokenizer

    path = launch.tiny_llama_dir()
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config = json.loads(Path(path, "config.json").read_text())
    text = "omni thinker | question 1.2: héllo wörld ✓ \n\t{\"json\": [1, 2]}"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode()) and all(3 <= i < 259 <= config["vocab_size"] for i in ids)
    assert tokenizer.decode(ids) == text
    assert [tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, config["bos_token_id"],
                                                                            config["eos_token_id"]]


def test_a_per_user_directory_that_is_a_symlink_is_refused(private_tmp: Path) -> None:
    elsewhere = private_tmp / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, private_tmp / f"omni-cache-{os.getuid()}")
    with pytest.raises(ValueError, match="is not a directory of this user"):
        launch.default_delivery_dir()


# ------------------------------------------------------------------------------------------ CLI
_PARSE_ONLY = """
import sys
from omni_cache.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print(exc.code, sorted(m for m in ("torch", "numpy", "vllm") if m in sys.modules))
"""


@pytest.mark.parametrize(("argv", "phrase"), [
    (["serve", "tiny-llama", "--delivery-max-bytes", "0"], "argument --delivery-max-bytes: wants an integer >= 1"),
    (["serve", "tiny-llama", "--delivery-timeout", "-1"], "argument --delivery-timeout: wants a number > 0"),
    (["serve", "tiny-llama", "--worker-cls", "my.Worker"], "--worker-cls my.Worker: the cache runs in"),
    (["serve", "tiny-llama", "--no-enable-prefix-caching"], "--no-enable-prefix-caching: the cache keeps"),
    (["serve", "tiny-llama", "--kv-transfer-config", "{bad"], "--kv-transfer-config is not JSON"),
    (["serve", "tiny-llama", "--worker-cl", "my.Worker"], "--worker-cl: spell out --worker-cls"),
    (["serve", "tiny-llama", "--delivery_timeout", "-1"], "argument --delivery-timeout: wants a number > 0"),
    (["serve", "tiny-llama", "--include-output-tokens", "yes", "--port", "8011"],
     "--include-output-tokens takes no value, got 'yes'"),
    (["serve", "tiny-llama", "--port", "8011", "--allow-custom-save-path", "true"],
     "--allow-custom-save-path takes no value, got 'true'"),
    (["serve", "--port", "8011"], "unrecognized arguments: --port"),
    (["serve", "tiny-llama", "--dry-run", "--delivery-max-byte", "5"],
     "--delivery-max-byte: not an option of omni-cache serve; did you mean --delivery-max-bytes?"),
    (["serve", "tiny-llama", "--include_output_token"],
     "--include_output_token: not an option of omni-cache serve; did you mean --include-output-tokens?"),
    (["serve", "tiny-llama", "--delivery-directory=/tmp/x"], "did you mean --delivery-dir?"),
    (["serve", "tiny-llama", "--tensor-parallel-size", "two"], "--tensor-parallel-size wants an integer"),
    (["serve", "tiny-llama", "--delivery-dir", ""], "--delivery-dir wants a directory path, got ''"),
    (["serve", "tiny-llama", "--delivery-dir", "/dev/null"], "omni_cache.delivery_dir '/dev/null' is an existing "
                                                             "file, not a directory"),
    (["serve", "tiny-llama", "--delivery-dir", "/tmp/a", "--kv-transfer-config",
      '{"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {"omni_cache": {"delivery_dir": "/tmp/b"}}}'],
     "--delivery-dir '/tmp/a' and the --kv-transfer-config's omni_cache.delivery_dir '/tmp/b' disagree"),
    (["serve", "tiny-llama", "--kv-transfer-config",
      '{"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {"omni_cache": {"delivery_timeout_s": 0}}}'],
     "omni_cache.delivery_timeout_s must be a positive number, got 0"),
    (["check-server", "ftp://127.0.0.1:1"], "argument URL: wants http://HOST:PORT"),
    (["check-server", "http://[::1"], "argument URL: wants http://HOST:PORT, got 'http://[::1' (Invalid IPv6 URL)"),
    (["check-server", "http://127.0.0.1:99999"], "argument URL: wants http://HOST:PORT, got 'http://127.0.0.1:99999' "
                                                 "(Port out of range 0-65535)"),
    (["check-server", "http://127.0.0.1:0"], "argument URL: wants a port from 1 to 65535"),
    (["check-server", "http://:8011"], "argument URL: wants http://HOST:PORT, got 'http://:8011'"),
    (["check-server", "http://127.0.0.1:8011/v1"], "argument URL: wants http://HOST:PORT (the server's root: the "
                                                   "checker adds /v1/...; a proxy's prefix may come before it), got "
                                                   "'http://127.0.0.1:8011/v1'"),
    (["check-server", "http://gw:8011/vllm/v1/"], "argument URL: wants http://HOST:PORT (the server's root"),
    (["check-server", "http://127.0.0.1:1", "--families", "0"], "argument --families: wants an integer from 1"),
    (["check-server", "http://127.0.0.1:1", "--tolerance", "2"], "argument --tolerance: wants a number from 0 to 1"),
])
def test_an_argument_error_is_one_line_exit_2_before_torch(argv: list[str], phrase: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _PARSE_ONLY, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.stdout.splitlines()[0] == "2 []", (done.stdout, done.stderr[-500:])
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and phrase in errors[0], done.stderr
    assert f"usage: omni-cache {argv[0]}" in done.stderr and "Traceback" not in done.stderr


def test_serve_dry_run_prints_the_server_command(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("omni-cache serve needs vLLM installed (the [vllm] extra)")
    monkeypatch.chdir(tmp_path)
    code = main(["serve", "tiny-llama", "--port", "8011", "--delivery-dir", "files", "--delivery-timeout", "2.5",
                 "--include-output-tokens", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("VLLM_USE_V2_MODEL_RUNNER=")
    argv = out.split()
    assert _option(argv, "--port") == ["8011"] and _option(argv, "--host") == ["127.0.0.1"]
    assert _option(argv, "--middleware") == ["omni_cache.integration.request_check.KvTransferParamsCheck"]
    config = json.loads(out.split("--kv-transfer-config ", 1)[1].split(" --middleware")[0].strip("'"))
    assert config["kv_connector_extra_config"]["omni_cache"] == {
        "delivery_dir": str(tmp_path / "files"), "include_output_tokens": True, "delivery_timeout_s": 2.5}


@pytest.mark.parametrize("given", ["--delivery-dir", "own connector config"])
def test_serve_refuses_a_delivery_directory_another_server_holds(given: str, tmp_path: Path) -> None:
    """Before vLLM starts: one line, exit 2, naming the directory the server would deliver into (a
    user's own OmniKVConnector ``delivery_dir`` wins over the default) and the process holding it."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("omni-cache serve needs vLLM installed (the [vllm] extra)")
    from omni_cache.harness.served.process import free_port
    from omni_cache.integration.delivery_files import DeliveryStore

    files = tmp_path / "files"
    held = DeliveryStore(str(files), max_bytes=1 << 20, max_age_s=60.0)  # a running server's
    if given == "--delivery-dir":
        where = ["--delivery-dir", str(files)]
    else:
        own = {**launch.CONNECTOR, "kv_connector_extra_config": {"connectors": [],
                                                                   "omni_cache": {"delivery_dir": str(files)}}}
        where = ["--kv-transfer-config", json.dumps(own)]
    # a free port: were the refusal gone, the server would start there, and be killed below
    proc = subprocess.Popen([sys.executable, "-m", "omni_cache.cli", "serve", "tiny-llama", "--port", str(free_port()),
                             *where], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the server was started on a directory another server holds") from None
    finally:
        held.close()
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert proc.returncode == 2 and len(errors) == 1, stderr[-2000:]
    assert f"{files} is the delivery directory of another running server (process {os.getpid()})" in errors[0]
    assert "hidden-state files in" not in stderr, "the server was started anyway"


@pytest.mark.parametrize("theirs", [
    {"omni_cache": {"delivery_dir": None}},
    {"connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}], "omni_cache": {"delivery_dir": None}},
    {"omni_cache": {"delivery_dir": None, "delivery_timeout_s": 3}},
])
def test_a_users_delivery_dir_null_is_refused_as_such(theirs: dict[str, Any]) -> None:
    """``null`` turns delivery off, which the launcher exists for: said in those words, whatever else
    the config holds (not as a missing connector or a key that "needs omni_cache.delivery_dir")."""
    config = {"kv_connector": "OmniKVConnector", "kv_connector_extra_config": theirs}
    for flags in ({}, {"include_output_tokens": True}):
        with pytest.raises(ValueError, match=r"omni_cache\.delivery_dir null turns delivery off"):
            serve_command("some/model", ["--kv-transfer-config", json.dumps(config)], delivery=flags,
                          defaults={"delivery_dir": "/d"})


@pytest.mark.vllm
def test_no_option_of_vllms_server_reads_as_a_misspelt_serve_option() -> None:
    """The near-miss refusal of ``omni-cache serve``'s own options never takes one of vLLM's."""
    from vllm_support import require_vllm

    require_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    options = {o for a in make_arg_parser(FlexibleArgumentParser())._actions for o in a.option_strings
               if o.startswith("--")}
    assert len(options) > 100 and "--max-model-len" in options
    assert {o: near for o in sorted(options) if (near := launch.near_delivery_option(o)) is not None} == {}
