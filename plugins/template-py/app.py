"""A ferry transport in Python, made by `ferry plugins new NAME --lang python`.

It writes each event's id, type and text payload to ferry's log, after an optional `prefix` from
the route's config, and refuses payloads that are not UTF-8 text as permanent failures. Replace
`deliver_one` with your delivery.

componentize-py generates the `wit_world` modules imported below from the WIT package in wit/
when it builds the component.
"""

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import logging
from wit_world.imports.types import (
    Event,
    Failure,
    Outcome,
    Outcome_Permanent,
    Outcome_Success,
    PluginInfo,
)

# What routes put in `plugin = "…"`; the file is installed in the plugins directory under this name.
NAME = "template-py"
VERSION = "0.1.0"


class Transport(exports.Transport):
    prefix = None

    def metadata(self) -> PluginInfo:
        return PluginInfo(name=NAME, version=VERSION)

    def init(self, config: list[tuple[str, str]]) -> None:
        """Called once per instance with the route's `config` table. Raise Err with a message
        that names the bad key to refuse the route."""
        values = dict(config)
        unknown = [key for key in values if key != "prefix"]
        if unknown:
            raise Err(f"unknown config key {unknown[0]!r} (known: prefix)")
        Transport.prefix = values.get("prefix", "")

    def deliver_batch(self, events: list[Event]) -> list[Outcome]:
        """One outcome per event, in the order given."""
        if Transport.prefix is None:
            return [permanent(f"{NAME}: init was not called") for _ in events]
        return [deliver_one(Transport.prefix, event) for event in events]


def deliver_one(prefix: str, event: Event) -> Outcome:
    try:
        text = event.payload.decode("utf-8")
    except UnicodeDecodeError:
        return permanent("payload is not UTF-8 text")
    logging.log(logging.Level.INFO, f"{prefix}{event.id} {event.event_type}: {text}")
    return Outcome_Success()


def permanent(reason: str) -> Outcome:
    return Outcome_Permanent(Failure(reason=reason, retry_after_ms=None))
