"""The one error style: `where: what`, with the seed's words kept."""
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ugent_common.validation import error_lines, error_location, first_error


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
    assert lines[0].startswith("plugins[0].id: ")
    assert any(line.startswith("plugins[1].extra: ") for line in lines)
