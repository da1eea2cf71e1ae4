"""Prints every record of a topic as JSON lines (partition, offset, key, value, headers; bytes
as UTF-8 text with replacement), read with kafka-python: a Kafka client that shares nothing with
ferry's kafka plugin. Usage: read.py BOOTSTRAP TOPIC [SASL_MECHANISM USER PASSWORD]; over TLS when KAFKA_SSL_CAFILE is
set (with KAFKA_SSL_CERTFILE and KAFKA_SSL_KEYFILE for a client certificate)."""

import json
import os
import sys
import time

from kafka import KafkaConsumer, TopicPartition


def text(value):
    return None if value is None else value.decode("utf-8", errors="replace")


def main():
    bootstrap, topic = sys.argv[1], sys.argv[2]
    options = {}
    if len(sys.argv) == 6:
        options = dict(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism=sys.argv[3],
            sasl_plain_username=sys.argv[4],
            sasl_plain_password=sys.argv[5],
        )
    # TLS: a CA file, and a client certificate and key for brokers that want one.
    if os.environ.get("KAFKA_SSL_CAFILE"):
        options.update(security_protocol="SSL", ssl_cafile=os.environ["KAFKA_SSL_CAFILE"])
        if os.environ.get("KAFKA_SSL_CERTFILE"):
            options.update(ssl_certfile=os.environ["KAFKA_SSL_CERTFILE"], ssl_keyfile=os.environ["KAFKA_SSL_KEYFILE"])
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, request_timeout_ms=10000, **options
    )
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    end = consumer.end_offsets(partitions)
    deadline = time.monotonic() + 20
    while any(consumer.position(tp) < end[tp] for tp in partitions):
        if time.monotonic() > deadline:
            sys.exit(f"timed out reading {topic}")
        for tp, records in consumer.poll(timeout_ms=500).items():
            for r in records:
                print(json.dumps({
                    "partition": tp.partition,
                    "offset": r.offset,
                    "key": text(r.key),
                    "value": text(r.value),
                    "headers": {k: text(v) for k, v in r.headers},
                }))
    consumer.close()


main()
