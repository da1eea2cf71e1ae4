"""A ferry transport in Python: drops each event as a JSON file into a spool directory that
another program consumes (a common hand-off between systems that share a disk).

Route configuration:
  dir            (required) the spool directory, inside a directory granted to the plugin with
                 `sandbox.spool-py.dirs`, e.g. "/spool" with dirs = { "/spool" = "var/spool" }
  pause_retry_ms how long to wait while the consumer has paused the spool (default 5000)

Outcomes:
  success    the file <dir>/<id>.json is in place (written to a temporary name, then renamed, so
             the consumer never sees half a file)
  transient  the consumer created <dir>/PAUSE (retried after pause_retry_ms), or the write failed
  permanent  the event says it is JSON but its payload does not parse
"""

import json
import os

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import logging
from wit_world.imports.types import (
    Event,
    Failure,
    Outcome,
    Outcome_Permanent,
    Outcome_Success,
    Outcome_Transient,
    PluginInfo,
)

KNOWN_KEYS = ("dir", "pause_retry_ms")


class Transport(exports.Transport):
    settings = None

    def metadata(self) -> PluginInfo:
        return PluginInfo(name="spool-py", version="0.1.0")

    def init(self, config: list[tuple[str, str]]) -> None:
        values = dict(config)
        unknown = [key for key in values if key not in KNOWN_KEYS]
        if unknown:
            raise Err(f"unknown config key {unknown[0]!r} (known: {', '.join(KNOWN_KEYS)})")
        if not values.get("dir", "").strip():
            raise Err("dir: required")
        try:
            pause_retry_ms = int(values.get("pause_retry_ms", "5000"))
        except ValueError:
            raise Err(f"pause_retry_ms: not a number: {values['pause_retry_ms']!r}")
        directory = values["dir"]
        if not os.path.isdir(directory):
            raise Err(f"dir: {directory!r} is not a directory the plugin can reach (grant it in sandbox.spool-py.dirs)")
        Transport.settings = (directory, pause_retry_ms)
        logging.log(logging.Level.INFO, f"spooling events into {directory}")

    def deliver_batch(self, events: list[Event]) -> list[Outcome]:
        if Transport.settings is None:
            return [permanent("spool-py: init was not called") for _ in events]
        directory, pause_retry_ms = Transport.settings
        if os.path.exists(os.path.join(directory, "PAUSE")):
            return [transient("the consumer paused the spool", pause_retry_ms) for _ in events]
        return [spool(directory, event) for event in events]


def spool(directory: str, event: Event) -> Outcome:
    text = event.payload.decode("utf-8", errors="replace")
    if event.content_type == "application/json":
        try:
            body = json.loads(text)
        except ValueError as error:
            return permanent(f"payload is not valid JSON: {error}")
    else:
        body = text
    envelope = {
        "id": event.id,
        "type": event.event_type,
        "route": event.route,
        "key": event.ordering_key,
        "attempt": event.attempt,
        "event_time_ms": event.event_time,
        "headers": dict(event.headers),
        "payload": body,
    }
    final = os.path.join(directory, f"{event.id}.json")
    try:
        with open(final + ".tmp", "w") as out:
            json.dump(envelope, out)
        os.rename(final + ".tmp", final)
    except OSError as error:
        return transient(f"cannot write {final}: {error}", None)
    return Outcome_Success()


def transient(reason: str, retry_after_ms) -> Outcome:
    return Outcome_Transient(Failure(reason=reason, retry_after_ms=retry_after_ms))


def permanent(reason: str) -> Outcome:
    return Outcome_Permanent(Failure(reason=reason, retry_after_ms=None))
