"""StructuredOutputs: exactly one constraint, validated with errors naming the field; a canonical
cache key; OpenAI response_format mapping; the host package never imports jax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.structured.params import StructuredOutputs, StructuredOutputsError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kwargs, kind", [
    (dict(json={"type": "object"}), "json"),
    (dict(json='{"type": "string"}'), "json"),
    (dict(regex="[a-z]+"), "regex"),
    (dict(choice=["yes", "no"]), "choice"),
    (dict(grammar='start: "a"'), "grammar"),
    (dict(json_object=True), "json_object"),
])
def test_each_kind_alone_is_valid(kwargs, kind):
    assert StructuredOutputs(**kwargs).kind == kind


def test_none_set_is_an_error_listing_the_fields():
    with pytest.raises(StructuredOutputsError, match="exactly one of json, regex, choice"):
        StructuredOutputs()


def test_two_set_is_an_error_naming_both():
    with pytest.raises(StructuredOutputsError, match=r"got json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="a")


def test_json_object_false_with_another_kind_is_fine():
    assert StructuredOutputs(regex="a", json_object=False).kind == "regex"


@pytest.mark.parametrize("kwargs, field", [
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1, 2]), "structured_outputs.json must be a JSON schema"),
    (dict(json={"a": object()}), "structured_outputs.json is not JSON-serializable"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(regex=3), "structured_outputs.regex must be a non-empty string"),
    (dict(grammar=""), "structured_outputs.grammar must be a non-empty string"),
    (dict(choice="yes"), "structured_outputs.choice must be a list of strings"),
    (dict(choice=[]), "structured_outputs.choice must not be empty"),
    (dict(choice=["a", 1]), r"structured_outputs.choice\[1\] must be a non-empty string"),
    (dict(json_object="yes"), "structured_outputs.json_object must be a boolean"),
])
def test_malformed_field_is_a_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputs(**kwargs)


def test_schema_as_text_or_dict_in_any_key_order_shares_one_key():
    a = StructuredOutputs(json={"type": "object", "required": ["x"]})
    b = StructuredOutputs(json='{"required": ["x"], "type": "object"}')
    assert a.key == b.key and a == b and hash(a) == hash(b)
    assert a.json == {"type": "object", "required": ["x"]}, "json text is parsed"


def test_callers_dict_mutated_later_does_not_change_the_constraint():
    schema = {"type": "object"}
    so = StructuredOutputs(json=schema)
    schema["type"] = "string"
    assert so.json == {"type": "object"} and so.key == 'json:{"type":"object"}'


def test_kinds_with_the_same_text_have_different_keys():
    keys = {StructuredOutputs(regex="a").key, StructuredOutputs(grammar="a").key,
            StructuredOutputs(choice=["a"]).key}
    assert len(keys) == 3


def test_choice_is_kept_as_a_tuple_and_is_hashable():
    so = StructuredOutputs(choice=["a", "b"])
    assert so.choice == ("a", "b")
    assert {so: 1}[StructuredOutputs(choice=("a", "b"))] == 1


def test_is_frozen():
    with pytest.raises(AttributeError):
        StructuredOutputs(regex="a").regex = "b"


@pytest.mark.parametrize("response_format, expected", [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, StructuredOutputs(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                             "schema": {"type": "object"}}},
     StructuredOutputs(json={"type": "object"})),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, StructuredOutputs(json_object=True)),
])
def test_openai_response_format_maps_onto_structured_outputs(response_format, expected):
    assert StructuredOutputs.from_response_format(response_format) == expected


@pytest.mark.parametrize("response_format, message", [
    ({"type": "yaml"}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ("json", "response_format must be an object"),
])
def test_bad_response_format_is_a_value_error(response_format, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs.from_response_format(response_format)


@pytest.mark.parametrize("module", ["jaxserve.structured.params", "jaxserve.structured.compiler",
                                    "jaxserve.structured.matcher"])
def test_host_structured_modules_do_not_import_jax(module):
    code = (f"import sys; import {module}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'torch')); assert not heavy, f'imports {heavy[:5]}'")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{module} pulls in jax or torch:\n{result.stderr[-2000:]}"
