"""The kafka:// URL and the librdkafka settings around it (settings.py): the settings replicator's
guarantees rest on, and those that load code or switch TLS verification off, are refused before any
client is made; prefixes cannot reach Kafka's internal topics or another prefix's; credentials come
from the environment or a file, never the command line, and nothing printed carries them; every
malformed URL is one line."""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer_helpers import REPLICATOR, cli_env, run_cli, wait_until
from kafka_helpers import publish, read_committed
from replicator.errors import UserError
from replicator.targets.kafka.settings import KafkaSettings, parse_url
from replicator.targets.kafka.topics import SCHEMA_CONFIG, STATE_CONFIG, Topics, schema_topic, state_topic, table_topic

SECRET = "s3cret-Zq8"

# (setting, value) pairs replicator relies on, or that load code, run commands, or switch TLS
# verification off
FENCED = [
    ("isolation.level", "read_uncommitted"),
    ("transactional.id", "mine"),
    ("enable.idempotence", "false"),
    ("group.id", "mine"),
    ("enable.auto.commit", "true"),
    ("enable.auto.offset.store", "true"),
    ("auto.offset.reset", "latest"),
    ("bootstrap.servers", "elsewhere:9092"),
    ("metadata.broker.list", "elsewhere:9092"),
    ("plugin.library.paths", "/tmp/x.so"),
    ("interceptors", "x"),
    ("ssl.engine.location", "/tmp/x.so"),
    ("ssl.providers", "legacy"),
    ("sasl.kerberos.kinit.cmd", "touch /tmp/x"),
    ("sasl.kerberos.principal", "x; touch /tmp/x"),   # pasted into kinit's shell command
    ("enable.ssl.certificate.verification", "false"),
    ("ssl.endpoint.identification.algorithm", "none"),
    ("partitioner", "random"),
]


def url_with(*options: str, prefix: str = "shop") -> str:
    return f"kafka://127.0.0.1:9092/{prefix}" + ("?" + "&".join(options) if options else "")


# the fence ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("setting", "value"), FENCED)
def test_a_setting_replicator_relies_on_or_that_runs_code_is_refused(setting: str, value: str) -> None:
    with pytest.raises(UserError, match=f"'{setting}'.* is refused"):
        parse_url(url_with(f"kafka.{setting}={value}"), environ={})


@pytest.mark.parametrize(("setting", "value"), FENCED)
def test_the_fence_holds_for_the_environment_and_the_settings_file(tmp_path: Path, setting: str, value: str) -> None:
    variable = "REPLICATOR_KAFKA_" + setting.upper().replace(".", "_")
    with pytest.raises(UserError, match=variable):
        parse_url(url_with(), environ={variable: value})
    config = tmp_path / "kafka.properties"
    config.write_text(f"# ours\nsecurity.protocol=SSL\n{setting} = {value}\n")
    # a name the fence knows is named with why; another (a misspelling may be a secret) by its line only
    refused = (f"'{setting}' in {config} line 3 is refused" if setting != "partitioner" else
               f"{config} line 3 is not NAME=VALUE with NAME a librdkafka setting")
    with pytest.raises(UserError, match=refused):
        parse_url(url_with(), environ={"REPLICATOR_KAFKA_CONFIG": str(config)})


def test_the_settings_users_need_pass_through_and_tls_verification_may_be_named_on() -> None:
    parsed = parse_url(url_with("kafka.security.protocol=SASL_SSL", "kafka.sasl.mechanism=SCRAM-SHA-512",
                                "kafka.sasl.username=app", "kafka.ssl.ca.location=/etc/ca.pem",
                                "kafka.enable.ssl.certificate.verification=true",
                                "kafka.ssl.endpoint.identification.algorithm=https",
                                "kafka.client.id=replicator-shop", "kafka.socket.timeout.ms=5000",
                                "kafka.compression.type=zstd", "kafka.linger.ms=20",
                                "kafka.message.max.bytes=2000000"), environ={})
    assert parsed.client["sasl.mechanism"] == "SCRAM-SHA-512"
    assert parsed.client["enable.ssl.certificate.verification"] == "true"
    assert parsed.timeout == 5.0
    config = parsed.config(**{"isolation.level": "read_committed"})
    assert config["bootstrap.servers"] == "127.0.0.1:9092" and config["isolation.level"] == "read_committed"


def test_a_shared_library_named_as_a_plugin_is_never_loaded(tmp_path: Path) -> None:
    """kafka.plugin.library.paths made librdkafka dlopen() the library (its constructor ran) before the
    client was refused; replicator refuses the setting before any client is made."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    marker = tmp_path / "plugin-ran"
    source = tmp_path / "plugin.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    library = tmp_path / "libplugin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    replica = tmp_path / "replica.db"
    result = run_cli("", "consume", "--source", url_with(f"kafka.plugin.library.paths={library}"),
                     "--target", f"sqlite:{replica}", "--until-caught-up", timeout=60)
    assert not marker.exists(), "the plugin's code ran"
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert "plugin.library.paths" in result.stderr and "loads code" in result.stderr
    assert not replica.exists()


def test_a_follower_reading_uncommitted_records_is_refused_and_never_applies_an_aborted_transaction(
        dsn: str, conn: psycopg.Connection, kafka, kafka_prefix: str, tmp_path: Path) -> None:
    """kafka.isolation.level=read_uncommitted overrode the follower's read_committed: it applied a
    record of a transaction Kafka aborted."""
    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO orders SELECT g, 'v' || g FROM generate_series(1, 3) g")
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 'orders')")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    assert publish(dsn, url).returncode == 0
    topic = table_topic(kafka_prefix, "public", "orders")
    first = next(r for r in read_committed(kafka.bootstrap, topic) if r.key_payload == {"id": 1})
    # a transaction Kafka aborts: row 1 as it never was, then the publisher's next commit after it
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": f"intruder-{uuid.uuid4()}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    assert first.value is not None
    producer.produce(topic, first.value.replace(b'"v1"', b'"aborted"'), first.key, partition=first.partition,
                     headers=list(first.headers.items()))
    producer.flush(30)
    producer.abort_transaction(30)
    conn.execute("UPDATE orders SET v = 'changed' WHERE id = 2")
    assert publish(dsn, url).returncode == 0

    replica = tmp_path / "replica.db"
    result = run_cli(dsn, "consume", "--source", f"{url}?kafka.isolation.level=read_uncommitted",
                     "--target", f"sqlite:{replica}", "--until-caught-up", timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: ") and "isolation.level" in result.stderr, result.stderr
    assert not replica.exists()
    assert run_cli(dsn, "consume", "--source", url, "--target", f"sqlite:{replica}", "--until-caught-up",
                   timeout=120).returncode == 0
    with sqlite3.connect(replica) as db:
        assert dict(db.execute("SELECT id, v FROM orders")) == {1: "v1", 2: "changed", 3: "v3"}


# prefixes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["__consumer_offsets", "__transaction_state", "__replicator", "__replicator.shop",
                                    "p5.public.orders", "a..b", ".a", "a.", "a b", "a/b", "a:b",
                                    "x" * 121])
def test_a_prefix_that_could_reach_another_or_kafkas_internal_topics_is_refused(prefix: str) -> None:
    with pytest.raises(UserError, match="invalid topic prefix"):
        parse_url(url_with(prefix=prefix), environ={})


@pytest.mark.parametrize("prefix", ["shop", "p5", "_shop", "shop-eu_1", "server1.inventory"])
def test_a_prefix_of_one_or_two_names_is_taken(prefix: str) -> None:
    assert parse_url(url_with(prefix=prefix), environ={}).prefix == prefix


_name = st.text(alphabet=st.sampled_from("ab._-"), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(_name, min_size=1, max_size=4), st.lists(_name, min_size=1, max_size=4),
       st.tuples(_name, _name), st.tuples(_name, _name))
def test_no_topic_of_one_prefix_is_a_topic_of_another(first: list[str], second: list[str],
                                                      first_table: tuple[str, str],
                                                      second_table: tuple[str, str]) -> None:
    """The prefix rule (at most two names) keeps each prefix's topics its own: PREFIX is one or two
    parts, PREFIX.schema.table three or four, __replicator.PREFIX starts with what no prefix may."""
    prefixes = []
    for names in (first, second):
        try:
            prefixes.append(parse_url(url_with(prefix=".".join(names)), environ={}).prefix)
        except UserError:
            return
    a, b = prefixes
    if a == b:
        return
    topics_a = {schema_topic(a), state_topic(a), table_topic(a, *first_table)}
    topics_b = {schema_topic(b), state_topic(b), table_topic(b, *second_table)}
    assert not topics_a & topics_b, (a, b)


# credentials -------------------------------------------------------------------------------------

@pytest.fixture
def queue(dsn: str) -> str:
    """Queue q capturing table t: what a publisher needs before it opens its target."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
        conn.execute("SELECT replicator.create_queue('q')")
        conn.execute("SELECT replicator.add_table('q', 't')")
    return "q"


def test_credentials_in_the_url_are_refused_without_echoing_them(dsn: str, queue: str, tmp_path: Path) -> None:
    for url in (f"kafka://app:{SECRET}@127.0.0.1:9/shop", f"kafka://app:{SECRET}@[::1/shop",
                f"kafka://app:{SECRET}@127.0.0.1:9/shop?kafka.sasl.mechanism=PLAIN"):
        for args in (["consume", queue, "--target", url], ["consume", "--source", url, "--target", f"sqlite:{tmp_path / 'x.db'}"]):
            result = run_cli(dsn, *args, timeout=60)
            assert result.returncode == 1, result.stderr
            assert SECRET not in result.stderr + result.stdout, result.stderr
            assert result.stderr.count("\n") == 1 and "REPLICATOR_KAFKA_SASL_PASSWORD" in result.stderr, result.stderr


@pytest.mark.parametrize("source", [f"postgresql://app:{SECRET}@db/shop", f"dbname=shop password={SECRET}", "shop"])
def test_a_database_given_to_source_is_refused_naming_dsn_without_echoing_it(source: str, tmp_path: Path) -> None:
    """--source names a publisher's topics: a newcomer giving it the source database is told where that
    goes, and the text, which may hold a password, is not printed."""
    result = run_cli("", "consume", "--source", source, "--target", f"sqlite:{tmp_path / 'x.db'}", timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and "--dsn" in result.stderr and "kafka://" in result.stderr, result.stderr
    assert SECRET not in result.stderr + result.stdout
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("setting", ["sasl.password", "ssl.key.password", "sasl.oauthbearer.client.secret"])
def test_a_secret_setting_on_the_command_line_is_refused_naming_where_it_goes(setting: str) -> None:
    with pytest.raises(UserError, match="REPLICATOR_KAFKA_") as raised:
        parse_url(url_with(f"kafka.{setting}={SECRET}"), environ={})
    assert SECRET not in str(raised.value)


def test_settings_come_from_the_environment_and_a_file(tmp_path: Path) -> None:
    config = tmp_path / "client.properties"
    config.write_text(f"security.protocol=SASL_SSL\nsasl.mechanism=PLAIN\n\n! a comment\nsasl.password={SECRET}\n")
    parsed = parse_url(url_with("kafka.client.id=shop"), environ={
        "REPLICATOR_KAFKA_CONFIG": str(config), "REPLICATOR_KAFKA_SASL_USERNAME": "app", "HOME": "/"})
    assert parsed.client == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.password": SECRET,
                             "sasl.username": "app", "client.id": "shop"}
    assert SECRET not in repr(parsed) and SECRET not in parsed.name


def test_a_setting_given_differently_twice_or_an_unknown_variable_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="given differently in the environment and in the Kafka URL"):
        parse_url(url_with("kafka.sasl.username=a"), environ={"REPLICATOR_KAFKA_SASL_USERNAME": "b"})
    with pytest.raises(UserError, match="REPLICATOR_KAFKA_SASL_PASWORD names no Kafka setting"):
        parse_url(url_with(), environ={"REPLICATOR_KAFKA_SASL_PASWORD": SECRET})
    config = tmp_path / "bad.properties"
    config.write_text(f"{SECRET}\n")
    with pytest.raises(UserError, match="line 1 is not NAME=VALUE") as raised:
        parse_url(url_with(), environ={"REPLICATOR_KAFKA_CONFIG": str(config)})
    assert SECRET not in str(raised.value)
    with pytest.raises(UserError, match="cannot read the Kafka settings file"):
        parse_url(url_with(), environ={"REPLICATOR_KAFKA_CONFIG": str(tmp_path / "missing")})


def test_nothing_a_failing_follower_prints_or_logs_carries_the_password(kafka, kafka_prefix: str,
                                                                        tmp_path: Path) -> None:
    """Credentials from the environment reach librdkafka (its debug log lists them, redacted) and no
    line of stdout or stderr, librdkafka's debug log forwarded included, holds the password, while the
    follower fails to authenticate (SASL against a plaintext listener) again and again."""
    url = (f"kafka://{kafka.bootstrap}/{kafka_prefix}?kafka.debug=security,conf,broker&kafka.log_level=7"
           f"&kafka.security.protocol=SASL_PLAINTEXT&kafka.sasl.mechanism=PLAIN")
    log = tmp_path / "follower.log"
    with open(log, "wb") as output:
        follower = subprocess.Popen([str(REPLICATOR), "-v", "consume", "--source", url, "--target",
                                     f"sqlite:{tmp_path / 'replica.db'}"], stdout=output, stderr=output,
                                    env={**cli_env(""), "REPLICATOR_KAFKA_SASL_USERNAME": "app",
                                         "REPLICATOR_KAFKA_SASL_PASSWORD": SECRET})
        try:
            wait_until(lambda: "sasl.password = [redacted]" in log.read_text(errors="replace")
                       and log.read_text(errors="replace").count("SASL") > 20, 60,
                       "librdkafka's log of its configuration and SASL attempts")
        finally:
            follower.kill()
            follower.wait(30)
    assert SECRET not in log.read_text(errors="replace")


# malformed URLs ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "says"), [
    ("kafka://[::1/p", "invalid broker '[::1'"),
    ("kafka://h:0/p", "invalid broker 'h:0'"),
    ("kafka://h:65536/p", "invalid broker"),
    ("kafka://h:port/p", "invalid broker"),
    ("kafka:///p", "no broker given"),
    ("kafka://h,,i/p", "no broker given"),
    ("kafka://h", "no topic prefix"),
    ("kafka://h/p?colour=red", "unknown option 'colour'"),
    ("kafka://h/p?partitions=two", "invalid partitions='two'"),
    ("kafka://h/p?partitions=1&partitions=2", "given twice"),
    ("kafka:/h/p", "invalid Kafka URL"),
])
def test_a_malformed_url_is_one_line(dsn: str, tmp_path: Path, url: str, says: str) -> None:
    result = run_cli(dsn, "consume", "--source", url, "--target", f"sqlite:{tmp_path / 'x.db'}", timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert says in result.stderr and "internal error" not in result.stderr, result.stderr


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("kafk:/@[]?&=.,_-%#ab19 \n\x00é")), max_size=40)
       | st.text(max_size=40).map(lambda rest: "kafka://" + rest))
def test_parsing_any_url_text_is_settings_or_a_user_error(text: str) -> None:
    try:
        parsed = parse_url(text, environ={})
    except UserError:
        pass
    else:
        assert isinstance(parsed, KafkaSettings) and parsed.prefix and parsed.brokers


@pytest.mark.parametrize("line", [
    "sasl.password: c2VjcmV0Cg==",     # Java properties' "name: value" (base64 secrets end in "=")
    "sasl.password c2VjcmV0Cg==",      # Java properties' "name value"
    "sasl.pass=word=c2VjcmV0Cg==",     # an unknown name
    "c2VjcmV0Cg==",
])
def test_a_settings_file_line_it_cannot_take_is_named_by_its_number_only(tmp_path: Path, line: str) -> None:
    config = tmp_path / "kafka.properties"
    config.write_text("# the client's settings\n" + line + "\n")
    with pytest.raises(UserError, match=f"{config} line 2") as raised:
        parse_url(url_with(), {"REPLICATOR_KAFKA_CONFIG": str(config)})
    assert "c2VjcmV0" not in str(raised.value) and "sasl.pass" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize("url", [f"kafka:user:{SECRET}@broker:9092/p", f"kafka:/user:{SECRET}@broker:9092/p",
                                 f"kafka:user:{SECRET}@a@broker:9092/p", f"Kafka://user:{SECRET}@broker:9092/p"])
def test_a_kafka_url_missing_a_slash_is_refused_without_its_credentials(url: str) -> None:
    with pytest.raises(UserError) as raised:
        parse_url(url, {})
    assert SECRET not in str(raised.value) and "user" not in str(raised.value), str(raised.value)


def test_the_projects_test_broker_variable_is_outside_the_settings_space() -> None:
    """bin/kafkaserver.py reads where the test broker's jars are cached from a variable outside
    REPLICATOR_KAFKA_* (every name there is a setting, or refused): a developer who sets it can use
    kafka:// URLs."""
    kafkaserver = (Path(__file__).parent.parent / "bin" / "kafkaserver.py").read_text()
    assert "REPLICATOR_TEST_KAFKA_JARS" in kafkaserver and "REPLICATOR_KAFKA_JARS" not in kafkaserver
    with pytest.raises(UserError, match="REPLICATOR_KAFKA_JARS names no Kafka setting"):
        parse_url(url_with(), {"REPLICATOR_KAFKA_JARS": "/opt/kafka-jars"})
    assert parse_url(url_with(), {"REPLICATOR_TEST_KAFKA_JARS": "/opt/kafka-jars"}).prefix == "shop"


@pytest.mark.parametrize("url", [f"https://app:{SECRET}@idp.example/token", f"https://idp.example/token?key={SECRET}"])
def test_a_token_endpoint_url_librdkafka_would_log_with_credentials_is_refused(url: str) -> None:
    with pytest.raises(UserError, match=r"sasl\.oauthbearer\.token\.endpoint\.url.* is refused") as raised:
        parse_url(url_with(), {"REPLICATOR_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL": url})
    assert SECRET not in str(raised.value)
    assert parse_url(url_with(), {"REPLICATOR_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL": "https://idp.example/token"})


@pytest.mark.parametrize("ciphers", ["aNULL", "ALL:@SECLEVEL=0", "HIGH"])
def test_a_cipher_list_that_could_admit_an_unauthenticated_broker_is_refused(ciphers: str) -> None:
    with pytest.raises(UserError, match=r"'ssl\.cipher\.suites'.* is refused"):
        parse_url(url_with(f"kafka.ssl.cipher.suites={ciphers}"), environ={})


def test_a_prefix_whose_topics_kafka_reads_as_anothers_is_refused_naming_both(kafka, kafka_prefix: str) -> None:
    """Kafka refuses a topic whose name equals an existing one's with '.' read as '_' (their metrics
    collide): prefixes x.y and x_y both pass the prefix rule; the second is refused in one line."""
    first, second = f"{kafka_prefix}.y", f"{kafka_prefix}_y"
    Topics(parse_url(f"kafka://{kafka.bootstrap}/{first}", environ={})).ensure(schema_topic(first), SCHEMA_CONFIG)
    topics = Topics(parse_url(f"kafka://{kafka.bootstrap}/{second}", environ={}))
    with pytest.raises(UserError, match=f"topic {second} would collide with topic {re.escape(first)}"):
        topics.ensure(schema_topic(second), SCHEMA_CONFIG)
    with pytest.raises(UserError, match=f"topic {re.escape(state_topic(second))} .*topic {re.escape(state_topic(first))}"):
        Topics(parse_url(f"kafka://{kafka.bootstrap}/{first}", environ={})).ensure(state_topic(first), STATE_CONFIG)
        topics.ensure(state_topic(second), STATE_CONFIG)


class _CountedAdmin:
    """The real admin client, its topic listings counted."""

    def __init__(self, admin: Any) -> None:
        self.admin, self.listings = admin, 0

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        self.listings += 1
        return self.admin.list_topics(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.admin, name)


def test_creating_a_topic_per_table_lists_the_brokers_topics_a_bounded_number_of_times(kafka, kafka_prefix: str) -> None:
    """A publisher's first copy of N tables creates N topics: listing every topic twice for each (to
    find it, then its partitions) made that quadratic in the topics on the brokers (bin/bench-scale)."""
    topics = Topics(parse_url(f"kafka://{kafka.bootstrap}/{kafka_prefix}", environ={}))
    counted = topics.admin = _CountedAdmin(topics.admin)
    names = [table_topic(kafka_prefix, "public", f"t{i}") for i in range(30)]
    assert [topics.ensure_table(name) for name in names] == [1] * 30
    assert counted.listings <= 2
    # (a topic created is listed once its broker has applied the controller's metadata, a moment later)
    wait_until(lambda: set(names) <= set(counted.admin.list_topics(timeout=10).topics), 30, "the topics listed")
    assert Topics(parse_url(f"kafka://{kafka.bootstrap}/{kafka_prefix}", environ={})).ensure_table(names[0]) == 1


def test_two_tables_whose_topics_kafka_reads_as_one_are_refused_naming_both(dsn: str, kafka,
                                                                             kafka_prefix: str) -> None:
    """a.b_c and a_b.c publish to PREFIX.a.b_c and PREFIX.a_b.c, one topic to Kafka."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('CREATE SCHEMA a; CREATE SCHEMA a_b; CREATE TABLE a.b_c (id int PRIMARY KEY);'
                     ' CREATE TABLE a_b.c (id int PRIMARY KEY)')
        conn.execute("SELECT replicator.create_queue('q')")
        conn.execute("SELECT replicator.add_table('q', 'a.b_c')")
        conn.execute("SELECT replicator.add_table('q', 'a_b.c')")
    result = publish(dsn, f"kafka://{kafka.bootstrap}/{kafka_prefix}")
    error = result.stderr.splitlines()[-1]
    assert result.returncode == 1 and error.startswith("error: "), result.stderr
    assert "a_b.c and a.b_c would both publish" in error or "a.b_c and a_b.c would both publish" in error, error
