"""Constraint workloads for structured output: ten JSON schemas, regexes and choice lists.

The schemas cover what constrained decoding must handle (nested objects, arrays with bounds,
enums, required fields, numbers with ranges, strings with patterns), and each has a prompt
asking a model for it. Tests, the grammar-library measurement (scripts/grammar_libs.py) and the
structured-output benchmark share them. Plain data only: this module must not import a grammar
library or jax.
"""

from __future__ import annotations

JSON_SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "address": {  # nested object
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 60},
            "city": {"type": "string", "maxLength": 40},
            "geo": {"type": "object",
                    "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                   "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                    "required": ["lat", "lon"], "additionalProperties": False},
        },
        "required": ["street", "city", "geo"], "additionalProperties": False,
    },
    "tags": {  # array with bounds
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False,
    },
    "sentiment": {  # enum
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "confidence"], "additionalProperties": False,
    },
    "product": {  # required subset, optional fields
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                       "title": {"type": "string", "maxLength": 30},
                       "price": {"type": "number", "minimum": 0, "maximum": 10000},
                       "in_stock": {"type": "boolean"}},
        "required": ["id", "title"], "additionalProperties": False,
    },
    "contact": {  # strings with patterns
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["phone", "zip", "code"], "additionalProperties": False,
    },
    "matrix": {  # nested arrays with bounds, integer ranges
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 3,
                                "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                          "items": {"type": "integer", "minimum": -9,
                                                    "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False,
    },
    "order": {  # array of objects, enum inside
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD[0-9]{3}$"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"sku": {"type": "string", "maxLength": 8},
                                               "qty": {"type": "integer", "minimum": 1,
                                                       "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False}},
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["order_id", "items", "status"], "additionalProperties": False,
    },
    "event": {  # anyOf, const, nullable
        "type": "object",
        "properties": {"kind": {"const": "event"},
                       "when": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2400},
                                          {"type": "null"}]},
                       "note": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["kind", "when", "note"], "additionalProperties": False,
    },
    "scores": {  # number ranges with exclusive bounds, array of numbers
        "type": "object",
        "properties": {"player": {"type": "string", "pattern": "^[a-z]{3,8}$"},
                       "scores": {"type": "array", "minItems": 1, "maxItems": 5,
                                  "items": {"type": "number", "exclusiveMinimum": 0,
                                            "maximum": 100}},
                       "level": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["player", "scores", "level"], "additionalProperties": False,
    },
}

PROMPTS: dict[str, str] = {
    "person": "Give a JSON object describing a person with a name and an age.",
    "address": "Give a JSON object with a street, a city and geo coordinates (lat, lon).",
    "tags": "Give a JSON object with a list of one to four short tags for a cooking blog post.",
    "sentiment": "Classify 'I loved this film' as JSON with a label and a confidence.",
    "product": "Give a JSON object for a product in a shop: id, title, price, in_stock.",
    "contact": "Give a JSON contact card: phone like 555-1234, a 5-digit zip, a code like AB12.",
    "matrix": "Give a JSON object with a small integer matrix under the key rows.",
    "order": "Give a JSON order with an order_id like ORD123, a list of items and a status.",
    "event": "Give a JSON event object with kind, when (a time or null) and a note.",
    "scores": "Give a JSON object with a lowercase player name, a list of scores and a level.",
}

REGEXES: dict[str, str] = {
    "date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    "yes_no": r"(yes|no)",
    "word_list": r"[a-z]{1,10}(, [a-z]{1,10}){0,3}",
}

CHOICES: dict[str, list[str]] = {
    "sentiment": ["positive", "negative", "neutral"],
    "colour": ["red", "green", "blue", "dark blue"],
}

# Lark grammar (llguidance's grammar syntax): arithmetic, nesting and lengths bounded so that
# every output ends whatever the logits
ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: factor (("*" | "/") factor){0,2}
factor: NUMBER | "(" inner ")"
inner: NUMBER (("+" | "-" | "*" | "/") NUMBER){0,3}
NUMBER: /[0-9]{1,3}/
"""
