"""The one error style: `where: what`, with the seed's words kept."""
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ugent_common.validation import StrList, error_lines, error_location, first_error, one_of, type_name

pytestmark = pytest.mark.mode_free  # no database, Redis or run mode


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    heartbeat_secs: float = 0

    @field_validator("heartbeat_secs")
    @classmethod
    def _non_negative(cls, v):
        if v < 0:
            raise ValueError("must be a non-negative number")
        return v


class Plugin(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    limits: Limits = Limits()


class File(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    plugins: list[Plugin]


def test_locations_read_as_paths():
    assert error_location(("plugins", 2, "limits", "x")) == "plugins[2].limits.x"
    assert error_location((0, "id"), root="rules") == "rules[0].id"


def test_a_validator_message_is_kept_word_for_word():
    with pytest.raises(ValidationError) as exc:
        File.model_validate({"plugins": [{"id": "a", "limits": {"heartbeat_secs": -1}}]})
    assert first_error(exc.value) == "plugins[0].limits.heartbeat_secs: must be a non-negative number"


def test_every_error_is_listed_in_order():
    with pytest.raises(ValidationError) as exc:
        File.model_validate({"plugins": [{"limits": {}}, {"id": 3, "extra": 1}]})
    lines = error_lines(exc.value)
    assert lines[0] == "plugins[0]: missing field `id`"
    assert "plugins[1].id: expected a string, found integer" in lines
    assert "plugins[1].extra: unknown field" in lines


def test_a_missing_key_is_reported_at_the_table_that_lacks_it():
    with pytest.raises(ValidationError) as exc:
        File.model_validate({"plugins": [{"id": "a"}, {}]})
    assert first_error(exc.value) == "plugins[1]: missing field `id`"


def test_an_entry_of_a_named_list_carries_its_name():
    data = {"plugins": [{"id": "a"}, {"id": "telegram-main", "limits": {"heartbeat_secs": "30"}}]}
    with pytest.raises(ValidationError) as exc:
        File.model_validate(data)
    assert first_error(exc.value, data=data, labels={"plugins": "id"}) == (
        "plugins[1] (telegram-main).limits.heartbeat_secs: expected a number, found string")
    assert first_error(exc.value) == "plugins[1].limits.heartbeat_secs: expected a number, found string"


def test_a_name_that_is_not_a_string_is_not_shown_as_one():
    data = {"plugins": [{"id": 7}]}
    with pytest.raises(ValidationError) as exc:
        File.model_validate(data)
    assert first_error(exc.value, data=data, labels={"plugins": "id"}) == "plugins[0].id: expected a string, found integer"


@pytest.mark.parametrize("value, found", [(True, "boolean"), (1, "integer"), (1.5, "float"), ("s", "string"),
                                          ([1], "array"), ({}, "table")])
def test_types_are_named_as_toml_names_them(value, found):
    assert type_name(value) == found


Overlap = one_of("skip", "queue", "allow")  # (named: pyflakes read the words in an annotation as names)


class Shared(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tags: StrList = []
    overlap: Overlap = "skip"


@pytest.mark.parametrize("data, line", [
    ({"tags": "x"}, "tags: expected an array of strings, found string"),
    ({"tags": ["a", 3]}, "tags: expected an array of strings, found integer at [1]"),
    ({"overlap": "sometimes"}, "overlap: 'sometimes' is not one of skip, queue, allow"),
    ({"overlap": 1}, "overlap: expected a string, found integer"),
])
def test_shared_declarations_word_their_errors_once(data, line):
    with pytest.raises(ValidationError) as exc:
        Shared.model_validate(data)
    assert first_error(exc.value) == line


def test_a_strict_shape_refuses_a_string_for_a_number():
    with pytest.raises(ValidationError) as exc:
        Limits.model_validate({"heartbeat_secs": "1"})
    assert first_error(exc.value) == "heartbeat_secs: expected a number, found string"
    assert Limits.model_validate({"heartbeat_secs": 1}).heartbeat_secs == 1.0


def test_first_repeat_names_both_places():
    from ugent_common.validation import first_repeat
    assert first_repeat(["a", "b", "a", "b"]) == (0, 2)
    assert first_repeat(x for x in ["a", "b"]) is None
