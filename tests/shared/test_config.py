import pytest

from shared.config import ConfigError, engine_config, env_overrides, load_config
from shared.subjects import Subjects, client_reply


def test_defaults_need_no_file():
    config = load_config(None, {})
    assert config.nats.url == "nats://127.0.0.1:4222" and config.nats.prefix == "llm"
    assert config.engine_config("executor-3").executor_name == "executor-3"


def test_yaml_then_environment(tmp_path):
    path = tmp_path / "jetserve.yaml"
    path.write_text("kv_cache:\n  block_size: 32\nscheduler:\n  batch_level:\n    max_num_seqs: 8\n")
    config = load_config(str(path), {"JETSERVE_SCHEDULER__BATCH_LEVEL__MAX_NUM_SEQS": "4",
                                     "NATS_URL": "nats://example:4223"})
    assert config.kv_cache.block_size == 32
    assert config.scheduler.batch_level.max_num_seqs == 4  # the environment wins
    assert config.nats.url == "nats://example:4223"
    engine = config.engine_config("e")
    assert (engine.kv_cache.block_size, engine.batch.max_num_seqs) == (32, 4)


@pytest.mark.parametrize("environ, needle", [
    ({"JETSERVE_KV_CACHE__BLOCK_SIZE": "big"}, "$.kv_cache.block_size"),
    ({"JETSERVE_KV_CACHE__BLOKSIZE": "8"}, "unknown field `bloksize` - at `$.kv_cache`"),
    ({"JETSERVE_NATS__PREFIX": "a.b"}, "$.nats.prefix"),
    ({"JETSERVE_NATS__CLIENT_INBOX_PREFIX": "$SYS"}, "$.nats.client_inbox_prefix"),
    ({"JETSERVE_NATS__CLIENT_INBOX_PREFIX": "_INBOX.>"}, "$.nats.client_inbox_prefix"),
    ({"JETSERVE_NATS__CLIENT_INBOX_PREFIX": "llm.inbox"},
     "nats.client_inbox_prefix (llm.inbox) must not be under nats.prefix (llm)"),
    ({"JETSERVE_SCHEDULER__REQUEST_LEVEL__MAX_PENDING_REQUESTS": "0"},
     "$.scheduler.request_level.max_pending_requests"),
    # Timings under which live holders would be taken for dead: each names both keys.
    ({"JETSERVE_DISTRIBUTED__HEARTBEAT_TIMEOUT_S": "2.5"},
     "distributed.heartbeat_timeout_s (2.5) must be at least three times "
     "distributed.heartbeat_interval_s (1)"),
    ({"JETSERVE_DISTRIBUTED__HEARTBEAT_INTERVAL_S": "2", "JETSERVE_NATS__ACK_WAIT_S": "5",
      "JETSERVE_DISTRIBUTED__HEARTBEAT_TIMEOUT_S": "10"},
     "nats.ack_wait_s (5) must be at least three times distributed.heartbeat_interval_s (2)"),
])
def test_errors_name_the_key(environ, needle):
    with pytest.raises(ConfigError) as error:
        load_config(None, environ)
    assert needle in str(error.value)


def test_a_bad_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="bad.yaml: the top level must be a mapping"):
        load_config(str(path), {})


def test_env_overrides_round_trip():
    environ = env_overrides({"model.name": "dummy:tiny", "token_level_off": None,
                             "scheduler.token_level.pipeline": False})
    assert environ == {"JETSERVE_MODEL__NAME": "dummy:tiny", "JETSERVE_TOKEN_LEVEL_OFF": "null",
                       "JETSERVE_SCHEDULER__TOKEN_LEVEL__PIPELINE": "false"}
    config = load_config(None, {k: v for k, v in environ.items() if "OFF" not in k})
    assert config.model.name == "dummy:tiny" and config.scheduler.token_level.pipeline is False


def test_the_example_file_is_every_default():
    from pathlib import Path

    import msgspec
    import yaml

    from shared.config import JetserveConfig

    path = Path(__file__).resolve().parents[2] / "jetserve.example.yaml"
    assert load_config(str(path), {}) == JetserveConfig()
    assert yaml.safe_load(path.read_text()) == msgspec.to_builtins(JetserveConfig())


def test_an_in_process_engine_takes_the_file_s_keys_and_checks():
    engine = engine_config({"kv_cache.num_blocks": 64, "model.quantization": "int8"},
                           max_wait_s=2.0)
    assert engine.kv_cache.num_blocks == 64 and engine.model.quantization == "int8"
    assert engine.max_wait_s == 2.0 and engine_config().max_wait_s is None  # off unless given
    with pytest.raises(ConfigError, match="kv_cache.num_blocks"):
        engine_config({"kv_cache.num_blocks": 1})
    with pytest.raises(ConfigError, match="compress_below_priority` needs `dtype: auto"):
        engine_config({"kv_cache.dtype": "int8", "kv_cache.compress_below_priority": 5})
    with pytest.raises(ConfigError, match="batch_size: adaptive"):
        engine_config({"scheduler.batch_level.batch_size": "adaptive"})
    # Values are taken as given, not read as YAML (a path may hold ` #`).
    assert engine_config({"model.name": "/models/run #2.gguf"}).model.name == "/models/run #2.gguf"


@pytest.mark.parametrize("reply, prefix, allowed", [
    ("_INBOX.abc", "_INBOX", True),
    ("_INBOX.abc.7", "_INBOX", True),
    ("acme.inbox.x", "acme.inbox", True),
    ("_INBOX", "_INBOX", False),  # the prefix alone: no inbox under it
    ("_INBOXX.abc", "_INBOX", False),
    ("acme.inboxes.x", "acme.inbox", False),
    ("llm.results.bob.r1", "_INBOX", False),  # another tenant's result
    ("llm.internal.priority.submit", "_INBOX", False),
    ("$JS.API.STREAM.DELETE.LLM_RESULTS", "_INBOX", False),
    ("_INBOX.*", "_INBOX", False),  # wildcards
    ("_INBOX.a.>", "_INBOX", False),
    ("_INBOX..a", "_INBOX", False),  # an empty token
])
def test_only_a_client_inbox_is_a_reply_subject(reply, prefix, allowed):
    assert client_reply(reply, prefix) is allowed


@pytest.mark.parametrize("subject, key", [
    ("llm.requests.acme.order-42", ("acme", "order-42")),
    ("llm.requests.acme", None),  # protocol v1's: no id token
    ("llm.requests.acme.a.b", None),
    ("llm.requests.ac:me.r1", None),
    ("llm.requests.acme." + "x" * 129, None),
])
def test_a_durable_subject_names_its_tenant_and_id(subject, key):
    assert Subjects("llm").durable_key(subject) == key


@pytest.mark.parametrize("settings, error", [
    ({"USER": "a", "TOKEN": "t"}, "one kind of credentials, not user/password and token"),
    ({"USER": "a"}, "nats.user and nats.password"),
    ({"PASSWORD": "p", "PASSWORD_FILE": "/f"}, "give one"),
    ({"TLS": "{cert: c.pem}"}, "nats.tls.cert and nats.tls.key go together"),
])
def test_credentials_of_one_kind_whole(settings, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, {f"JETSERVE_NATS__{k}": v for k, v in settings.items()})


def test_a_password_file_is_read_at_connect_and_named_when_missing(tmp_path):
    from shared.bus import connect_options

    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    config = load_config(None, {"JETSERVE_NATS__USER": "svc",
                                "JETSERVE_NATS__PASSWORD_FILE": str(secret)})
    assert connect_options(config.nats) == {"user": "svc", "password": "s3cret"}
    secret.unlink()
    with pytest.raises(ConfigError, match="nats.password_file"):
        connect_options(config.nats)


def test_variables_that_are_not_configuration_are_left_alone():
    """JETSERVE_CPU_ARCH (the kernels' build) and JETSERVE_CONTAINER_CLUSTER (the container
    test) made every config load fail ("unknown field `cpu_arch`"); a section's name with one
    underscore for two is still a typo named as such."""
    config = load_config(None, {"JETSERVE_CPU_ARCH": "x86-64-v3",
                                "JETSERVE_CONTAINER_CLUSTER": "1"})
    assert config == load_config(None, {})
    with pytest.raises(ConfigError, match="kv_cache_block_size"):
        load_config(None, {"JETSERVE_KV_CACHE_BLOCK_SIZE": "32"})


@pytest.mark.parametrize("raw, expected", [("abc #def", "abc #def"), ("*star", "*star"),
                                           ("@at", "@at"), ("[open", "[open"),
                                           ('"123456"', "123456"), ("plain", "plain")])
def test_a_secret_from_the_environment_is_taken_as_written(raw, expected):
    """Typed as YAML, `abc #def` lost its `#def` as a comment, and `*star` or `[open` were a
    traceback; a text is now kept whole (quotes make digits a text)."""
    config = load_config(None, {"JETSERVE_NATS__USER": "u", "JETSERVE_NATS__PASSWORD": raw})
    assert config.nats.password == expected


def test_an_environment_value_is_stripped_and_a_yaml_tag_still_types_it():
    config = load_config(None, {"JETSERVE_NATS__USER": "u",
                                "JETSERVE_NATS__PASSWORD": "s3cret\n",
                                "JETSERVE_MODEL__DEVICE": "cpu "})
    assert config.nats.password == "s3cret" and config.model.device == "cpu"
    tagged = load_config(None, {"JETSERVE_NATS__USER": "u",
                                "JETSERVE_NATS__PASSWORD": "!!str 123456"})
    assert tagged.nats.password == "123456"


def test_a_key_given_twice_or_a_file_not_in_utf8_is_named(tmp_path):
    """YAML keeps the last of two equal keys: a section given twice lost the first one's keys
    without a word. A file that is not UTF-8 was a traceback."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("kv_cache:\n  block_size: 32\nkv_cache:\n  num_blocks: 100\n")
    with pytest.raises(ConfigError, match="twice.yaml.*`kv_cache` is given twice"):
        load_config(str(twice), {})
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("model:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml"):
        load_config(str(binary), {})
