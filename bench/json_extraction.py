"""A JSON-extraction prompt set: short texts about people, orders, events and books, each with
the JSON schema of what to extract from it.

The texts are built from seeded random records (names, cities, products, dates drawn from fixed
lists), so the set needs no data file and every prompt has a known answer; the schema is shown
in the prompt as well, as extraction prompts do. `schema_errors` checks an output against the
subset of JSON Schema these schemas use, independently of the grammar engine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

FIRST = ("Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Margaret", "Linus")
LAST = ("Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson", "Hamilton")
CITIES = ("London", "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Oslo", "Prague", "Dublin")
PRODUCTS = ("keyboard", "monitor", "laptop stand", "USB cable", "webcam", "headset", "desk lamp")
TOPICS = ("compilers", "databases", "robotics", "cryptography", "graphics", "networks")
GENRES = ("mystery", "fantasy", "history", "poetry", "science fiction")

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation", "email"],
    "additionalProperties": False,
}
_ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 40},
        "customer": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer"},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "express"],
    "additionalProperties": False,
}
_EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "city": {"type": "string", "maxLength": 40},
        "speakers": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
        "online": {"type": "boolean"},
    },
    "required": ["title", "date", "city", "speakers", "online"],
    "additionalProperties": False,
}
_BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"},
        "genre": {"enum": list(GENRES)},
        "pages": {"type": "integer"},
    },
    "required": ["title", "author", "year", "genre", "pages"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ExtractionPrompt:
    instruction: str  # the user message: the text, the schema, the request for JSON only
    schema: dict[str, Any]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _person(rng: random.Random) -> tuple[str, dict[str, Any]]:
    name, age, city = _name(rng), rng.randint(21, 79), rng.choice(CITIES)
    job = rng.choice(("an engineer", "a teacher", "a nurse", "a pilot", "a chemist"))
    mail = f"{name.split()[0].lower()}.{name.split()[1].lower()}@example.org"
    text = (
        f"{name} is {age} years old and works as {job} in {city}. You can reach {name.split()[0]} at {mail}."
    )
    return text, _PERSON


def _order(rng: random.Random) -> tuple[str, dict[str, Any]]:
    items = rng.sample(PRODUCTS, rng.randint(2, 3))
    listed = ", ".join(f"{rng.randint(1, 5)} x {item}" for item in items)
    express = rng.choice((True, False))
    text = (
        f"Order A-{rng.randint(1000, 9999)} was placed by {_name(rng)}: {listed}. "
        f"Shipping: {'express' if express else 'standard'}."
    )
    return text, _ORDER


def _event(rng: random.Random) -> tuple[str, dict[str, Any]]:
    topic, city = rng.choice(TOPICS), rng.choice(CITIES)
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    speakers = " and ".join(_name(rng) for _ in range(2))
    where = "streamed online and held" if rng.random() < 0.5 else "held"
    text = f"The {city} {topic.title()} Summit is {where} in {city} on {date}, with talks by {speakers}."
    return text, _EVENT


def _book(rng: random.Random) -> tuple[str, dict[str, Any]]:
    genre = rng.choice(GENRES)
    adjective, noun = (
        rng.choice(("Silent", "Last", "Hidden", "Endless")),
        rng.choice(("River", "Tower", "Garden")),
    )
    title = f"The {adjective} {noun}"
    text = (
        f'"{title}" is a {genre} novel by {_name(rng)}, first published in {rng.randint(1950, 2024)}; '
        f"it runs to {rng.randint(150, 600)} pages."
    )
    return text, _BOOK


def json_extraction_prompts(count: int, seed: int = 0) -> list[ExtractionPrompt]:
    """`count` prompts cycling through the four kinds of record."""
    rng = random.Random(seed)
    makers = (_person, _order, _event, _book)
    prompts = []
    for i in range(count):
        text, schema = makers[i % len(makers)](rng)
        instruction = (
            f"Extract the information from this text as JSON.\n\nText: {text}\n\n"
            f"JSON schema: {json.dumps(schema)}\n\nAnswer with the JSON object only."
        )
        prompts.append(ExtractionPrompt(instruction, schema))
    return prompts


def schema_errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Where `value` breaks `schema` (type, enum, properties, required, additionalProperties, items,
    maxItems, maxLength; a pattern is not checked): an empty list when it conforms."""
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{where}: {value!r} not in {schema['enum']}"]
    kind = schema.get("type")
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
    }
    if kind is None:
        return []
    if not isinstance(value, types[kind]) or (kind in ("integer", "number") and isinstance(value, bool)):
        return [f"{where}: expected {kind}, got {type(value).__name__}"]
    errors = []
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{where}: missing {key}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected {key}")
    elif kind == "string" and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{where}: longer than {schema['maxLength']} characters")
    elif kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: more than {schema['maxItems']} items")
        for i, item in enumerate(value if "items" in schema else ()):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors
